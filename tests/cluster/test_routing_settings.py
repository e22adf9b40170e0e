"""The routing settings of ``pdserve serve`` and ``pdserve worker --role router`` reach the
router's config; bad ones are refused naming the setting and where it came from."""

import argparse

import pytest

from pdserve.cluster import worker_cli
from pdserve.cluster.serve_config import build
from pdserve.cluster.worker_router import router_config
from pdserve.cluster.settings import SettingsError, add_arguments, resolve
from pdserve.router.kv_policy import RoutingConfig


def parse(argv, settings=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, settings)
    return parser.parse_args(argv)


def test_routing_flags_file_and_env_reach_the_router(tmp_path):
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("routing_temperature: 0.5\nrouting_balance_rel: 3\n")
    argv = ["--config", str(config_file), "--routing-policy", "round_robin", "--routing-prefill-weight", "2",
            "--routing-balance-abs-tokens", "100"]
    routing = build(resolve(parse(argv), environ={"PDSERVE_ROUTING_LOAD_WEIGHT": "0.25"})).router_limits.routing
    assert routing == RoutingConfig(policy="round_robin", prefill_weight=2.0, load_weight=0.25, temperature=0.5,
                                    balance_abs_tokens=100, balance_rel=3.0)
    assert build(resolve(parse([]), environ={})).router_limits.routing == RoutingConfig()  # kv by default


def plain_router(argv):
    """The settings of ``pdserve worker --role router`` with ``argv``."""
    return worker_cli.settings(parse(["--role", "router", *argv], worker_cli.worker_settings()), environ={})


def test_a_plain_router_process_takes_the_same_settings():
    assert router_config(plain_router(["--routing-policy", "load"])).limits.routing.policy == "load"


@pytest.mark.parametrize("argv, environ, message", [
    ([], {"PDSERVE_ROUTING_POLICY": "fastest"},
     "PDSERVE_ROUTING_POLICY: 'fastest' is not one of kv, load, round_robin"),
    (["--routing-temperature", "-1"], {}, "--routing-temperature: routing_temperature must be at least 0"),
    (["--routing-balance-rel", "0.5"], {}, "--routing-balance-rel: routing_balance_rel must be at least 1"),
    (["--routing-load-weight", "x"], {}, "--routing-load-weight: 'x' is not a valid float for routing_load_weight"),
])
def test_bad_routing_values_name_the_setting(argv, environ, message):
    with pytest.raises(SettingsError) as exc:
        resolve(parse(argv), environ=environ)
    assert message in str(exc.value)


def test_stream_kv_min_tokens_reaches_both_router_processes_and_refuses_a_negative():
    assert build(resolve(parse([]), environ={})).router_limits.stream_kv_min_tokens == 0  # off by default
    values = resolve(parse([]), environ={"PDSERVE_STREAM_KV_MIN_TOKENS": "1024"})
    assert build(values).router_limits.stream_kv_min_tokens == 1024
    assert router_config(plain_router(["--stream-kv-min-tokens", "2048"])).limits.stream_kv_min_tokens == 2048
    with pytest.raises(SettingsError) as exc:
        resolve(parse(["--stream-kv-min-tokens", "-1"]), environ={})
    assert "--stream-kv-min-tokens" in str(exc.value) and "at least 0" in str(exc.value)


def test_the_body_limit_holds_the_longest_prompt_and_settings_that_break_that_are_refused():
    """max_body_bytes bounds how long one body's JSON holds the router's loop, so it is small
    (1 MiB); a prompt of max_prompt_chars non-ASCII characters, written as Python's json.dumps
    writes it (\\u escapes), must still fit. Settings that break that are refused, naming both."""
    import json

    from pdserve.router.validation import RequestLimits

    limits = build(resolve(parse([]), environ={})).router_limits.requests
    assert limits == RequestLimits()
    longest = json.dumps({"model": "smollm2", "prompt": "\u00e9" * limits.max_prompt_chars, "max_tokens": 16})
    assert len(longest.encode()) <= limits.max_body_bytes
    with pytest.raises(SettingsError) as exc:
        build(resolve(parse(["--max-body-bytes", "100000"]), environ={}))
    assert "max_body_bytes=100000" in str(exc.value) and "max_prompt_chars=131072" in str(exc.value)
    build(resolve(parse(["--max-body-bytes", "100000", "--max-prompt-chars", "10000"]), environ={}))

"""Where ``pdserve serve`` settings come from: defaults < YAML file < PDSERVE_* < flags."""

import dataclasses

import pytest

from pdserve.cli import main
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import LEASE_SECONDS, SettingsError, resolve
from pdserve.engine.config import DISAGGREGATED_MIXED_PREFILL_TOKENS, CacheConfig, EngineConfig, SchedulerConfig
from pdserve.router.limits import RouterLimits
from pdserve.router.local_prefill import LocalPrefillConfig
from tests.factories import decode_worker_config, prefill_worker_config
from tests.helpers.settings import parse
from pdserve.wire.logs import LogConfig


def test_defaults():
    v = resolve(parse([]), environ={})
    assert (v.engine.model, v.layout.prefill, v.api.port, v.api.grpc_port, v.kv.kv_transfer_backend) == (
        "default", 1, 8000, 50051, "nixl")


def test_port_is_http_as_in_vllm_serve_and_grpc_port_is_grpc():
    config = build(resolve(parse(["--port", "8100", "--grpc-port", "50100"]), environ={}))
    assert (config.http_port, config.grpc_port) == (8100, 50100)
    assert build(resolve(parse(["--port", "-1"]), environ={})).http_port is None  # gRPC only


def test_every_default_is_its_owners():
    """The table's defaults are the config dataclasses' own: a default changed there changes
    the flag's, and the cluster built from no flags equals the dataclasses' defaults."""
    config = build(resolve(parse([]), environ={}))
    # (the overflow threshold alone is the TTFT objective's: tests/cluster/test_mode_settings.py)
    assert config.router_limits == dataclasses.replace(
        RouterLimits(), local_prefill=dataclasses.replace(LocalPrefillConfig(), overflow_ttft_s=1.0))
    assert config.lease_seconds == ClusterConfig().lease_seconds == LEASE_SECONDS.default
    assert (config.kv_transfer_backend == prefill_worker_config().kv_transfer_backend
            == decode_worker_config().kv_transfer_backend == ClusterConfig().kv_transfer_backend)
    # (the mixed prefill cap and step target alone are the layout's: tests/cluster/test_mode_settings.py)
    assert config.engine.scheduler == SchedulerConfig(mixed_prefill_tokens=DISAGGREGATED_MIXED_PREFILL_TOKENS,
                                                      mixed_step_target_s=0.05)
    assert config.engine.cache == CacheConfig()
    assert config.engine.seed == EngineConfig().seed and config.log == LogConfig()
    assert config.served_model_names == ClusterConfig().served_model_names == ("smollm2",)


def test_vllm_serve_flags_reach_the_configs(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = build(resolve(parse([
        "--served-model-name", "a", "b", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--no-enable-prefix-caching", "--chat-template", str(template), "--tokenizer", str(tmp_path), "--seed", "7",
        "--log-level", "debug", "--log-format", "json"]), environ={}))
    assert config.served_model_names == ("a", "b")
    assert (config.engine.scheduler.max_num_seqs, config.engine.scheduler.max_num_batched_tokens) == (8, 512)
    assert config.engine.cache.enable_prefix_cache is False and config.engine.seed == 7
    assert (config.chat_template, config.tokenizer) == (str(template), str(tmp_path))
    assert config.log == LogConfig("debug", "json")
    assert build(resolve(parse(["/models/x"]), environ={})).served_model_names == ("/models/x",)  # as vLLM


def test_list_and_bool_settings_from_env_and_file(tmp_path):
    v = resolve(parse([]), environ={"PDSERVE_SERVED_MODEL_NAME": "a, b", "PDSERVE_ENABLE_PREFIX_CACHING": "false"})
    assert v.api.served_model_name == ("a", "b") and v.engine.enable_prefix_caching is False
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("served_model_name: [x, y]\nenable-prefix-caching: no\n")
    v = resolve(parse(["--config", str(cfg), "--enable-prefix-caching"]), environ={})
    assert v.api.served_model_name == ("x", "y") and v.engine.enable_prefix_caching is True  # the flag beats the file


@pytest.mark.parametrize("argv, environ, message", [
    (["--max-num-seqs", "0"], {}, "--max-num-seqs: max_num_seqs must be at least 1, got 0"),
    (["--kv-cache-gib", "0"], {}, "--kv-cache-gib: kv_cache_gib must be greater than 0"),
    (["--grpc-port", "-1"], {}, "--grpc-port: grpc_port must be at least 0"),
    ([], {"PDSERVE_LEASE_SECONDS": "-3"}, "PDSERVE_LEASE_SECONDS: lease_seconds must be greater than 0"),
    ([], {"PDSERVE_ENABLE_PREFIX_CACHING": "maybe"}, "PDSERVE_ENABLE_PREFIX_CACHING: 'maybe' is not a valid bool"),
    ([], {"PDSERVE_SERVED_MODEL_NAME": " , "}, "served_model_name needs at least one name"),
    (["--seed", "x"], {}, "--seed: 'x' is not a valid int for seed"),
])
def test_a_bad_value_names_the_setting_and_where_it_came_from(argv, environ, message):
    with pytest.raises(SettingsError) as exc:
        resolve(parse(argv), environ=environ)
    assert message in str(exc.value)


def test_bad_paths_fail_before_the_cluster_starts(tmp_path):
    with pytest.raises(SettingsError, match="chat_template: cannot read"):
        build(resolve(parse(["--chat-template", str(tmp_path / "missing.jinja")]), environ={}))
    with pytest.raises(SettingsError, match="tokenizer: .* is not a directory"):
        build(resolve(parse(["--tokenizer", str(tmp_path / "nope")]), environ={}))


def test_pdserve_serve_exits_2_naming_the_bad_setting(capsys):
    assert main(["serve", "--max-num-batched-tokens", "0"]) == 2
    assert "max_num_batched_tokens must be at least 1" in capsys.readouterr().err


def test_file_then_env_then_flag(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("decode: 3\nkv-cache-gib: 2.5\ngrpc_port: 7000\nmodel: /models/x\n")
    v = resolve(parse(["--config", str(cfg), "--grpc-port", "9000"]), environ={"PDSERVE_DECODE": "4"})
    assert v.layout.decode == 4  # env beats the file
    assert v.api.grpc_port == 9000  # the flag beats the file
    assert v.engine.kv_cache_gib == 2.5 and v.engine.model == "/models/x"


def test_flag_beats_env():
    v = resolve(parse(["--prefill", "2", "other-model"]), environ={"PDSERVE_PREFILL": "5", "PDSERVE_MODEL": "m"})
    assert v.layout.prefill == 2 and v.engine.model == "other-model"


def test_unknown_file_key_is_named(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("prefil: 2\n")
    with pytest.raises(SettingsError, match="unknown setting 'prefil'"):
        resolve(parse(["--config", str(cfg)]), environ={})


def test_bad_env_value_names_the_variable():
    with pytest.raises(SettingsError, match="PDSERVE_DECODE.*not a valid int"):
        resolve(parse([]), environ={"PDSERVE_DECODE": "two"})
    with pytest.raises(SettingsError, match="PDSERVE_KV_TRANSFER_BACKEND.*not one of nixl, tcp for kv_transfer_backend"):
        resolve(parse([]), environ={"PDSERVE_KV_TRANSFER_BACKEND": "rdma"})


def test_autoscaling_section_comes_from_the_file(tmp_path):
    from pdserve.cluster.autoscaling import AutoscaleConfigError, from_mapping

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("autoscaling:\n  prefill: {max_replicas: 6}\n  decode: {step: 0}\n")
    v = resolve(parse(["--config", str(cfg)]), environ={})
    with pytest.raises(AutoscaleConfigError, match="autoscaling.decode.step"):
        from_mapping(v.autoscaling)
    cfg.write_text("autoscaling:\n  prefill: {max_replicas: 6}\n")
    pools = from_mapping(resolve(parse(["--config", str(cfg)]), environ={}).autoscaling)
    assert pools["prefill"].max_replicas == 6 and pools["decode"].max_replicas == 4
    assert resolve(parse([]), environ={}).autoscaling is None  # off unless configured


def test_chat_template_replaces_the_tokenizers_own(tmp_path):
    """``--chat-template`` as text or as a file, as the router's tokenizer applies it."""
    from pdserve.engine.loader import materialize
    from pdserve.engine.tokenizer import Tokenizer

    model_dir = materialize("default", progress=False)
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for value in (template, str(path)):
        tok = Tokenizer(model_dir, chat_template=value)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == tok.hf.encode("<<hi>>",
                                                                                           add_special_tokens=False)
    assert Tokenizer(model_dir).apply_chat_template([{"role": "user", "content": "hi"}]) != tok.apply_chat_template(
        [{"role": "user", "content": "hi"}])


def test_step_trace_dir_reaches_every_worker_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = build(resolve(parse(["--step-trace-dir", "steps"]), environ={}))
    assert config.step_trace_dir == str(tmp_path / "steps")  # Ray starts workers in a directory of its own
    assert {config.worker_config(role, 0).step_trace_dir for role in ("prefill", "decode")} == {config.step_trace_dir}
    assert build(resolve(parse([]), environ={})).step_trace_dir is None  # off unless asked for

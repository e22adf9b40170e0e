"""``--mode`` and the conditional-disaggregation settings: from the one settings table to the
cluster's and router's configs (no cluster started)."""

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.mode import COLOCATED, DISAGGREGATED
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, add_arguments, resolve
from pdserve.router.local_prefill import LocalPrefillConfig
from tests.helpers.settings import parse


def test_the_default_is_disaggregated_with_the_rule_off():
    config = build(resolve(parse([]), environ={}))
    assert config.mode == DISAGGREGATED and config.pools() == ("prefill", "decode")
    # the short-prompt rule off; prefill that keeps up on, at half the TTFT objective
    assert config.router_limits_for_mode().local_prefill == LocalPrefillConfig(overflow_ttft_s=1.0)
    assert not LocalPrefillConfig().max_tokens


@pytest.mark.parametrize("argv, seconds", [
    ([], 1.0),  # half of --layout-ttft-slo-s's 2 s
    (["--layout-ttft-slo-s", "4"], 2.0),
    (["--prefill-overflow-s", "0"], 0.0),  # off
    (["--prefill-overflow-s", "0.3"], 0.3),
])
def test_prefill_overflow_follows_the_ttft_objective_unless_given(argv, seconds):
    assert build(resolve(parse(argv), environ={})).router_limits.local_prefill.overflow_ttft_s == seconds


@pytest.mark.parametrize("argv, seconds", [
    ([], 0.05),  # half of --layout-tpot-slo-s's 0.1 s
    (["--layout-tpot-slo-s", "0.2"], 0.1),
    (["--elastic-roles"], 0.05),  # a decode worker that turns mixed, too
    (["--mode", "colocated"], 0.0),  # a colocated worker keeps its whole budget
    (["--mode", "colocated", "--mixed-step-target-s", "0.08"], 0.08),  # given, it wins
    (["--mixed-step-target-s", "0"], 0.0),  # the fixed cap
])
def test_the_mixed_step_target_follows_the_tpot_objective_unless_given(argv, seconds):
    assert build(resolve(parse(argv), environ={})).engine.scheduler.mixed_step_target_s == seconds


def test_colocated_runs_no_prefill_pool_and_tells_the_router(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("mode: colocated\ndecode: 2\nprefill: 3\n")
    config = build(resolve(parse(["--config", str(path)]), environ={}))
    assert (config.mode, config.num_prefill, config.num_decode) == (COLOCATED, 0, 2)
    assert config.pools() == ("decode",) and config.worker_threads() >= 1
    assert config.router_limits_for_mode().local_prefill.colocated
    assert not config.router_limits.local_prefill.colocated  # derived, not written back


@pytest.mark.parametrize("argv, cap", [
    ([], 32),  # disaggregated: a decode worker's local prefills are short suffixes, kept short a step
    (["--mode", "colocated"], 0),  # a colocated worker prefills every prompt: no cap
    (["--elastic-roles"], 0),  # nor an elastic worker that turns mixed
    (["--mixed-prefill-tokens", "48"], 48),
    (["--mode", "colocated", "--mixed-prefill-tokens", "16"], 16),  # the setting, given, wins
])
def test_the_mixed_prefill_cap_follows_the_layout_unless_given(argv, cap):
    assert build(resolve(parse(argv), environ={})).engine.scheduler.mixed_prefill_tokens == cap


def test_rule_thresholds_come_from_flags_and_variables():
    v = resolve(parse(["--local-prefill-max-tokens", "512"]), environ={"PDSERVE_LOCAL_PREFILL_MAX_LOAD": "0.25"})
    assert build(v).router_limits.local_prefill == LocalPrefillConfig(max_tokens=512, max_load=0.25, overflow_ttft_s=1.0)


@pytest.mark.parametrize("argv, environ, message", [
    ([], {"PDSERVE_MODE": "split"}, "PDSERVE_MODE: 'split' is not one of disaggregated, colocated for mode"),
    (["--local-prefill-max-tokens", "-1"], {}, "local_prefill_max_tokens must be at least 0"),
    ([], {"PDSERVE_LOCAL_PREFILL_MAX_LOAD": "0"}, "PDSERVE_LOCAL_PREFILL_MAX_LOAD: local_prefill_max_load must be "
                                                   "greater than 0"),
    (["--local-prefill-max-load", "1.5"], {}, "local_prefill_max_load must be at most 1"),
])
def test_bad_values_name_the_setting(argv, environ, message):
    with pytest.raises(SettingsError, match=message):
        build(resolve(parse(argv), environ=environ))


def test_a_colocated_cluster_config_with_prefill_workers_is_refused():
    with pytest.raises(ValueError, match="num_prefill must be 0 in colocated mode"):
        ClusterConfig(mode=COLOCATED, num_prefill=1)
    with pytest.raises(ValueError, match="mode must be one of disaggregated, colocated"):
        ClusterConfig(mode="both")


def test_a_router_run_as_a_plain_process_reads_the_rule_too():
    """``pdserve worker --role router`` (Kubernetes without Ray) builds its limits from the same table."""
    import argparse

    from pdserve.cluster import worker_cli
    from pdserve.cluster.settings import add_arguments
    from pdserve.cluster.worker_router import router_config

    parser = argparse.ArgumentParser()
    add_arguments(parser, worker_cli.worker_settings())
    v = worker_cli.settings(parser.parse_args(["--role", "router", "--local-prefill-max-tokens", "256"]), environ={})
    assert router_config(v).limits.local_prefill == LocalPrefillConfig(max_tokens=256, overflow_ttft_s=1.0)


def test_a_colocated_cluster_autoscales_only_its_decode_pool(tmp_path):
    """An ``autoscaling:`` section names both pools; colocated, only the decode pool exists, so
    only it is sampled and scaled (a prefill policy would start prefill workers from nothing)."""
    import time

    from pdserve.cluster.autoscaler import Autoscaler
    from pdserve.cluster.autoscaling import PoolSample

    path = tmp_path / "serve.yaml"
    path.write_text("mode: colocated\nautoscaling:\n  prefill: {min_replicas: 1}\n  decode: {min_replicas: 1}\n")
    config = build(resolve(parse(["--config", str(path)]), environ={}))
    assert set(config.autoscaling) == {"prefill", "decode"} and set(config.autoscaled_pools()) == {"decode"}

    class Cluster:
        def addresses(self, pool):
            return []

        def push_membership(self):
            pass

    sampled = []
    scaler = Autoscaler(Cluster(), config.autoscaled_pools(), observe_only=True)
    scaler._latency = lambda window_s: None  # no router here
    scaler.sample = lambda pool, now, latency=None: sampled.append(pool) or PoolSample(now, 1, kv_usage=0.1)
    scaler.step(time.monotonic())
    assert sampled == ["decode"] and set(scaler.desired()) == {"decode"}


def test_a_lease_shorter_than_the_kv_read_timeout_is_refused_at_start(capsys):
    """A claimed lease must outlive the read it was claimed for: with --lease-seconds 5 and
    a 10 s transfer timeout, held KV could be freed while a decode worker still reads it."""
    with pytest.raises(ValueError, match=r"lease_seconds \(5 s, --lease-seconds\) must exceed transfer_timeout_seconds "
                                         r"\(10 s, --transfer-timeout-seconds"):
        ClusterConfig(lease_seconds=5.0, transfer_timeout_s=10.0)
    assert ClusterConfig(lease_seconds=30.0, transfer_timeout_s=10.0).lease_seconds == 30.0
    from pdserve.cli import main

    assert main(["serve", "--lease-seconds", "10"]) == 2  # equal is refused too: no margin for the read
    err = capsys.readouterr().err
    assert "lease_seconds" in err and "transfer_timeout_seconds" in err and "Traceback" not in err


@pytest.mark.parametrize("role, given", [
    ("prefill", ["--lease-seconds", "10"]),  # equal to the default 10 s read timeout
    ("decode", ["--transfer-timeout-seconds", "45"]),  # above the default 30 s lease
    ("decode", ["--lease-seconds", "5", "--transfer-timeout-seconds", "5"])])
def test_pdserve_worker_refuses_a_lease_no_longer_than_the_kv_read_timeout_at_start(capsys, role, given):
    """``pdserve worker``, as the Kubernetes manifests run it, checks the pair as ``pdserve serve``
    does (it took any lease above 0): it exits 2 before anything starts, naming both settings."""
    from pdserve.cli import main

    assert main(["worker", "--role", role, "--router-admin", "127.0.0.1:1", *given]) == 2
    err = capsys.readouterr().err
    assert "lease_seconds" in err and "transfer_timeout_seconds" in err and "must exceed" in err
    assert "Traceback" not in err


def test_pdserve_worker_passes_the_transfer_settings_to_its_worker(monkeypatch):
    import argparse

    from pdserve.cluster import worker_cli

    parser = argparse.ArgumentParser()
    add_arguments(parser, worker_cli.worker_settings())
    monkeypatch.setenv("PDSERVE_TRANSFER_TIMEOUT_SECONDS", "4")
    argv = ["--role", "decode", "--router-admin", "127.0.0.1:1", "--lease-seconds", "6", "--no-verify-kv-transfers"]
    decode = worker_cli.worker_config(worker_cli.settings(parser.parse_args(argv)))
    assert (decode.transfer_timeout_s, decode.verify_kv) == (4.0, False)
    prefill = worker_cli.worker_config(worker_cli.settings(parser.parse_args(["--role", "prefill", *argv[2:]])))
    assert (prefill.lease_seconds, prefill.verify_kv) == (6.0, False)


def test_the_role_budget_comes_from_flags_and_needs_elastic_roles():
    assert build(resolve(parse([]), environ={})).role_budget is None
    config = build(resolve(parse(["--elastic-roles", "--role-budget", "--role-budget-dwell-s", "30"]),
                           environ={"PDSERVE_ROLE_BUDGET_WINDOW_S": "5"}))
    assert (config.role_budget.dwell_s, config.role_budget.window_s) == (30.0, 5.0)
    assert config.role_budget.mixed  # half moves with the mixed role, unless turned off
    assert config.role_budget.grace_s == 1.0  # then decode streams move with their KV
    assert build(resolve(parse(["--elastic-roles", "--role-budget", "--role-budget-grace-s", "0"]),
                         environ={})).role_budget.grace_s == 0.0
    whole = build(resolve(parse(["--elastic-roles", "--role-budget", "--no-role-budget-mixed"]), environ={}))
    assert not whole.role_budget.mixed
    assert config.budget_targets()["decode"].slo_s == 0.2  # the decode autoscaling defaults' ITL SLO
    own = build(resolve(parse(["--elastic-roles", "--role-budget", "--role-budget-itl-slo-s", "0.05"]), environ={}))
    assert own.budget_targets()["decode"].slo_s == 0.05 and own.budget_targets()["prefill"].slo_s == 2.0
    with pytest.raises(ValueError, match="role_budget needs elastic_roles"):
        build(resolve(parse(["--role-budget"]), environ={}))
    with pytest.raises(SettingsError, match="role_budget_dwell_s must be greater than 0"):
        resolve(parse(["--role-budget-dwell-s", "0"]), environ={})


def test_an_elastic_worker_is_pinned_as_a_plain_one():
    """LocalCluster._place pins a worker's config to its cores; an elastic worker's process is
    pinned by its decode core's settings whatever its role, and both cores carry them."""
    from pdserve.cluster.local import _pinned

    elastic = build(resolve(parse(["--elastic-roles"]), environ={}))
    for role in ("prefill", "decode"):
        pinned = _pinned(elastic.worker_config(role, 0), (1,), (0,))
        assert pinned.role == role
        for part in (pinned.decode, pinned.prefill):
            assert (part.cpus, part.borrow_cpus) == ((1,), (0,))
    plain = build(resolve(parse([]), environ={}))
    assert _pinned(plain.worker_config("decode", 0), (0,), ()).cpus == (0,)

"""Where ``pdserve serve`` settings come from: defaults < YAML file < PDSERVE_* < flags."""

import argparse

import pytest

from cluster.settings import SettingsError, add_arguments, resolve


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults():
    v = resolve(parse([]), environ={})
    assert (v["model"], v["prefill"], v["port"], v["http_port"], v["kv_transfer_backend"]) == (
        "default", 1, 50051, 8000, "nixl")


def test_file_then_env_then_flag(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("decode: 3\nkv-cache-gib: 2.5\nport: 7000\nmodel: /models/x\n")
    v = resolve(parse(["--config", str(cfg), "--port", "9000"]), environ={"PDSERVE_DECODE": "4"})
    assert v["decode"] == 4  # env beats the file
    assert v["port"] == 9000  # the flag beats the file
    assert v["kv_cache_gib"] == 2.5 and v["model"] == "/models/x"


def test_flag_beats_env():
    v = resolve(parse(["--prefill", "2", "other-model"]), environ={"PDSERVE_PREFILL": "5", "PDSERVE_MODEL": "m"})
    assert v["prefill"] == 2 and v["model"] == "other-model"


def test_unknown_file_key_is_named(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("prefil: 2\n")
    with pytest.raises(SettingsError, match="unknown setting 'prefil'"):
        resolve(parse(["--config", str(cfg)]), environ={})


def test_bad_env_value_names_the_variable():
    with pytest.raises(SettingsError, match="PDSERVE_DECODE.*not a valid int"):
        resolve(parse([]), environ={"PDSERVE_DECODE": "two"})
    with pytest.raises(SettingsError, match="PDSERVE_KV_TRANSFER_BACKEND.*not one of nixl, tcp"):
        resolve(parse([]), environ={"PDSERVE_KV_TRANSFER_BACKEND": "rdma"})


def test_autoscaling_section_comes_from_the_file(tmp_path):
    from cluster.autoscaling import AutoscaleConfigError, from_mapping

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("autoscaling:\n  prefill: {max_replicas: 6}\n  decode: {step: 0}\n")
    v = resolve(parse(["--config", str(cfg)]), environ={})
    with pytest.raises(AutoscaleConfigError, match="autoscaling.decode.step"):
        from_mapping(v["autoscaling"])
    cfg.write_text("autoscaling:\n  prefill: {max_replicas: 6}\n")
    pools = from_mapping(resolve(parse(["--config", str(cfg)]), environ={})["autoscaling"])
    assert pools["prefill"].max_replicas == 6 and pools["decode"].max_replicas == 4
    assert resolve(parse([]), environ={})["autoscaling"] is None  # off unless configured

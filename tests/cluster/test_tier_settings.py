"""The KV tier's settings (pdserve/cluster/tier_settings.py): ``--kv-offload-bytes`` (plain
bytes or with a unit) and ``--kv-offload-dir`` reach every worker's engine of both pools, from
``pdserve serve``, ``pdserve worker`` and the plain worker process alike; bad input is refused
at start naming the flag and the limit."""

import pytest

from pdserve.cluster import worker_cli, worker_process
from pdserve.cluster.serve_config import build
from pdserve.cluster.setting import ByteSize
from pdserve.cluster.settings import SettingsError, resolve
from pdserve.engine.config import KVTierConfig
from tests.helpers.settings import parse, worker


def test_no_tier_by_default_anywhere():
    config = build(resolve(parse([]), environ={}))
    assert config.prefill_engine.kv_tier is None and config.decode_engine.kv_tier is None
    assert worker_cli.worker_config(worker("prefill", [])).engine.kv_tier is None


def test_both_flags_reach_both_pools_elastic_workers_and_plain_workers(tmp_path):
    argv = ["--kv-offload-bytes", "8GiB", "--kv-offload-dir", str(tmp_path)]
    expected = KVTierConfig(offload_bytes=8 << 30, offload_dir=str(tmp_path))
    config = build(resolve(parse(argv), environ={}))
    assert config.prefill_engine.kv_tier == config.decode_engine.kv_tier == expected
    elastic = build(resolve(parse([*argv, "--elastic-roles"]), environ={}))
    assert elastic.prefill_engine.kv_tier == elastic.decode_engine.kv_tier == expected
    for role in ("prefill", "decode"):
        assert worker_cli.worker_config(worker(role, argv)).engine.kv_tier == expected
    for role in ("prefill", "decode"):
        assert worker_process._config(worker_process._parser().parse_args([role, *argv])).engine.kv_tier == expected


@pytest.mark.parametrize("raw, count", [("4096", 4096), ("8GiB", 8 << 30), ("1.5GiB", 3 << 29), ("512MiB", 512 << 20),
                                        ("2GB", 2 * 10 ** 9), ("64Mi", 64 << 20), ("10 kB", 10_000)])
def test_sizes_are_bytes_plain_or_with_a_unit(raw, count):
    assert build(resolve(parse(["--kv-offload-bytes", raw]), environ={})).decode_engine.kv_tier.offload_bytes == count


def test_the_variable_and_the_file_take_sizes_too(tmp_path, monkeypatch):
    env = {"PDSERVE_KV_OFFLOAD_BYTES": "1GiB"}
    assert build(resolve(parse([]), environ=env)).prefill_engine.kv_tier.offload_bytes == 1 << 30
    path = tmp_path / "serve.yaml"
    path.write_text("kv_offload_bytes: 2MiB\nkv_offload_dir: tier\n")
    monkeypatch.chdir(tmp_path)  # a relative directory is made absolute: workers start where Ray puts them
    tier = build(resolve(parse(["--config", str(path)]), environ={})).decode_engine.kv_tier
    assert tier == KVTierConfig(offload_bytes=2 << 20, offload_dir=str(tmp_path / "tier"))
    path.write_text("kv_offload_bytes: 65536\n")
    assert build(resolve(parse(["--config", str(path)]), environ={})).decode_engine.kv_tier.offload_bytes == 65536


@pytest.mark.parametrize("argv, message", [
    (["--kv-offload-bytes", "8XB"], r"--kv-offload-bytes: '8XB' is not a valid size in bytes .*for kv_offload_bytes"),
    (["--kv-offload-bytes", "-1"], r"--kv-offload-bytes: '-1' is not a valid size in bytes"),
    (["--kv-offload-bytes", "0"], "kv_offload_bytes must be at least 1, got 0"),
    (["--kv-offload-bytes", "1.5"], r"--kv-offload-bytes: '1.5' is not a valid size in bytes"),
    (["--kv-offload-dir", "/tmp/x"], "--kv-offload-dir needs --kv-offload-bytes"),
    (["--kv-offload-bytes", "1GiB", "--kv-offload-dir", " "], r"kv_offload_dir \(--kv-offload-dir\): an empty path"),
])
def test_bad_tier_settings_are_refused_naming_the_flag(argv, message):
    with pytest.raises(SettingsError, match=message):
        build(resolve(parse(argv), environ={}))
    with pytest.raises(SettingsError, match=message):
        worker_cli.worker_config(worker("decode", argv))


def test_a_tier_without_the_prefix_cache_is_refused_naming_both_flags():
    with pytest.raises(SettingsError, match=r"kv_offload_bytes \(--kv-offload-bytes\): the KV tier keeps the prefix "
                                            "cache's blocks; it needs --enable-prefix-caching"):
        build(resolve(parse(["--kv-offload-bytes", "1GiB", "--no-enable-prefix-caching"]), environ={}))


def test_a_worker_of_more_than_one_rank_is_refused_naming_the_flag_and_the_limit():
    with pytest.raises(SettingsError, match=r"--kv-offload-bytes\): the KV tier serves workers of "
                                            "tensor_parallel_size 1 only, got 2"):
        worker_cli.worker_config(worker("prefill", ["--kv-offload-bytes", "1GiB", "--tensor-parallel-size", "2",
                                                    "--kv-cache-memory", "1000000"]))


def test_the_plain_worker_process_refuses_a_bad_size_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        worker_process._parser().parse_args(["decode", "--kv-offload-bytes", "lots"])
    assert "--kv-offload-bytes: 'lots' is not a valid size in bytes" in capsys.readouterr().err


def test_a_byte_size_is_a_plain_count_of_bytes():
    assert ByteSize("3KiB") == 3072 and isinstance(ByteSize(7), int)
    with pytest.raises(ValueError, match="is not a size in bytes"):
        ByteSize("GiB")


def test_routing_tier_weight_reaches_both_routers_and_is_bounded():
    from pdserve.cluster.worker_router import router_config

    assert build(resolve(parse([]), environ={})).router_limits.routing.tier_weight == 0.1
    assert build(resolve(parse(["--routing-tier-weight", "0.3"]), environ={})).router_limits.routing.tier_weight == 0.3
    assert router_config(worker("router", ["--routing-tier-weight", "0.5"])).limits.routing.tier_weight == 0.5
    with pytest.raises(SettingsError, match="--routing-tier-weight: routing_tier_weight must be at least 0, got -0.5"):
        resolve(parse(["--routing-tier-weight", "-0.5"]), environ={})

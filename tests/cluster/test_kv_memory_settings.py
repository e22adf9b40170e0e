"""How the KV cache is sized, as settings: ``--kv-cache-memory`` and ``--kv-cache-gib`` exactly
(one of the two), ``--gpu-memory-utilization`` a share of the device, the 1 GiB default where
none is given; and ``pdserve worker --device``, the device a plain worker runs on."""

import argparse

import pytest
import torch

from pdserve.cli import main
from pdserve.cluster import worker_cli
from pdserve.cluster.plain_process import check_device
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, add_arguments, resolve
from pdserve.engine.config import DEFAULT_KV_CACHE_BYTES, CacheConfig
from pdserve.planner.auto_layout import worker_need_bytes
from tests.helpers.settings import parse

GIB = 1 << 30


def cache(argv, environ=None):
    return resolve(parse(argv), environ=environ or {}).engine.cache_config()


def plain(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser, worker_cli.worker_settings())
    args = parser.parse_args(["--role", "decode", "--router-admin", "127.0.0.1:1", *argv])
    return worker_cli.worker_config(worker_cli.settings(args, environ={})).engine


def test_the_default_is_one_gib_and_each_setting_sizes_it_its_way():
    assert cache([]).exact_budget_bytes() == DEFAULT_KV_CACHE_BYTES == GIB
    assert cache(["--kv-cache-gib", "0.5"]) == CacheConfig(memory_budget_bytes=GIB // 2)
    assert cache(["--kv-cache-memory", "123456789"]) == CacheConfig(memory_budget_bytes=123456789)
    share = cache(["--gpu-memory-utilization", "0.45"])
    assert share == CacheConfig(gpu_memory_utilization=0.45) and share.exact_budget_bytes() is None
    both = cache([], {"PDSERVE_KV_CACHE_MEMORY": "5000000", "PDSERVE_GPU_MEMORY_UTILIZATION": "0.9"})
    assert both.exact_budget_bytes() == 5000000  # an exact size wins over the share


def test_two_exact_sizes_are_refused_naming_both_wherever_they_come_from(capsys):
    message = ("kv_cache_memory (1000000 bytes, --kv-cache-memory) and kv_cache_gib (2 GiB, --kv-cache-gib) both "
               "size the KV cache exactly: give one")
    with pytest.raises(SettingsError) as exc:
        cache(["--kv-cache-memory", "1000000"], {"PDSERVE_KV_CACHE_GIB": "2"})
    assert str(exc.value) == message
    with pytest.raises(SettingsError, match="both size the KV cache exactly"):
        plain(["--kv-cache-memory", "1000000", "--kv-cache-gib", "1"])
    assert main(["serve", "--kv-cache-memory", "1000000", "--kv-cache-gib", "2"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [
    ("1.5", "--gpu-memory-utilization: gpu_memory_utilization must be at most 1, got 1.5"),
    ("0", "--gpu-memory-utilization: gpu_memory_utilization must be greater than 0, got 0.0"),
])
def test_a_share_outside_zero_to_one_is_refused(value, message):
    with pytest.raises(SettingsError) as exc:
        cache(["--gpu-memory-utilization", value])
    assert str(exc.value) == message


def test_a_plain_worker_takes_its_share_and_its_device():
    engine = plain(["--gpu-memory-utilization", "0.45", "--device", "cpu"])
    assert engine.cache.gpu_memory_utilization == 0.45 and engine.torch_device() == torch.device("cpu")
    assert plain([]).device is None  # the current CUDA device (CUDA_VISIBLE_DEVICES's first), else the CPU


def test_a_device_that_is_not_one_or_not_here_is_refused_naming_the_flag():
    with pytest.raises(SettingsError, match=r"^--device: 'gpu0' is not a device: cpu, cuda or cuda:N$"):
        check_device("gpu0")
    with pytest.raises(SettingsError, match=r"^--device: 'meta' is not a device"):
        check_device("meta")
    count = torch.cuda.device_count()  # 0 on a CPU host
    with pytest.raises(SettingsError) as exc:
        check_device(f"cuda:{count}", environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert str(exc.value) == (f"--device: cuda:{count} asks for CUDA device {count}, but this process sees {count} "
                              "(CUDA_VISIBLE_DEVICES=2,3)")
    with pytest.raises(SettingsError, match=f"--device: cuda:{count} asks for CUDA device {count}"):
        plain(["--device", f"cuda:{count}"])


def test_the_planner_sizes_a_worker_by_the_resolved_cache():
    weights = 300 << 20
    assert worker_need_bytes(weights, None) == weights + GIB
    assert worker_need_bytes(weights, CacheConfig(memory_budget_bytes=5 * GIB)) == weights + 5 * GIB
    # a share holds weights, activations and KV together: the worker takes that share of the host
    assert worker_need_bytes(weights, CacheConfig(gpu_memory_utilization=0.25), host_bytes=24 * GIB) == 6 * GIB


def test_a_share_with_tensor_parallelism_reaches_every_pools_engine(tool_llama):
    """Each rank measures its own use once loaded (pdserve/engine/distributed/memory_share.py)."""
    config = build(resolve(parse([str(tool_llama[0]), "--gpu-memory-utilization", "0.5", "--decode-tp", "2"]),
                           environ={}))
    decode = config.worker_config("decode", 0).engine
    assert decode.tensor_parallel_size == 2 and decode.cache.gpu_memory_utilization == 0.5

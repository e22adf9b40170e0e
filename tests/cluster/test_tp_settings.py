"""``--tensor-parallel-size`` (vLLM's flag) and per pool ``--prefill-tp`` / ``--decode-tp``:
each pool's workers get their size, Ray reserves a bundle per rank, and a size the model or the
KV transfer cannot take (pools of sizes where neither divides the other) stops ``pdserve serve`` before anything starts, naming the setting and
the limit."""

import argparse
import dataclasses

import pytest

from pdserve.cli import main
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.placement import PoolPlacement, actor_options
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, add_arguments, resolve
from pdserve.engine.config import EngineConfig


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def engines(config: ClusterConfig) -> dict[str, int]:
    return {role: config.worker_config(role, 0).engine.tensor_parallel_size for role in config.pools()}


def test_each_pools_workers_get_their_size(tool_llama):
    model = str(tool_llama[0])  # 4 heads, 2 KV heads: TP 2 divides it
    assert engines(build(resolve(parse([model]), environ={}))) == {"prefill": 1, "decode": 1}
    assert engines(build(resolve(parse([model, "--tensor-parallel-size", "2"]), environ={}))) == {"prefill": 2, "decode": 2}
    both = build(resolve(parse([model, "--prefill-tp", "2"]), environ={"PDSERVE_DECODE_TP": "2"}))
    assert engines(both) == {"prefill": 2, "decode": 2}
    colocated = build(resolve(parse([model, "--mode", "colocated", "--decode-tp", "2"]), environ={}))
    assert engines(colocated) == {"decode": 2}
    elastic = ClusterConfig(elastic_roles=True, engine=EngineConfig(tensor_parallel_size=2)).worker_config("prefill", 0)
    assert elastic.prefill.engine.tensor_parallel_size == elastic.decode.engine.tensor_parallel_size == 2


def test_a_size_the_model_does_not_divide_names_the_pool_and_the_heads():
    with pytest.raises(SettingsError, match=r"decode_tp: num_attention_heads \(9\) is not divisible by "
                                            r"tensor_parallel_size \(2\)"):
        build(resolve(parse(["--decode-tp", "2", "--prefill-tp", "3"]), environ={}))  # the default model: 9 heads, 3 KV heads


def test_pools_of_sizes_where_one_divides_the_other_each_get_theirs(tool_llama):
    """The KV moves by head between them; a prefill worker checksums each block in as many
    groups of heads as a decode rank reads of one prefill rank."""
    for prefill, decode in ((2, 1), (1, 2)):
        config = build(resolve(parse([str(tool_llama[0]), "--prefill-tp", str(prefill), "--decode-tp", str(decode)]),
                               environ={}))
        assert engines(config) == {"prefill": prefill, "decode": decode}
        assert config.worker_config("prefill", 0).reader_tp == decode


def test_each_pools_engine_is_built_at_its_size_in_one_place(tool_llama):
    """The router's engine and each pool's come from one builder, each at its own size: they
    differ in nothing else."""
    config = build(resolve(parse([str(tool_llama[0]), "--prefill-tp", "2"]), environ={}))
    assert (config.engine.tensor_parallel_size, config.prefill_engine.tensor_parallel_size,
            config.decode_engine.tensor_parallel_size) == (1, 2, 1)
    assert config.prefill_engine == dataclasses.replace(config.engine, tensor_parallel_size=2)
    assert config.decode_engine == config.engine


def tp(prefill: int, decode: int, **kwargs) -> dict:
    """``ClusterConfig`` arguments whose pools run at these sizes."""
    return dict(prefill_engine=EngineConfig(tensor_parallel_size=prefill),
                decode_engine=EngineConfig(tensor_parallel_size=decode), **kwargs)


@pytest.mark.parametrize("sizes, message", [
    (tp(2, 3), r"prefill_tp \(2\) and decode_tp \(3\) do not divide one another"),
    (tp(2, 1, elastic_roles=True), r"elastic workers change pools in place"),
])
def test_pool_sizes_the_kv_cannot_move_between_are_refused_naming_both(sizes, message):
    with pytest.raises(SettingsError, match=message):
        ClusterConfig(**sizes)


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size: tensor_parallel_size must be at least 1, got 0"),
    (["--decode-tp", "-1"], "--decode-tp: decode_tp must be at least 1, got -1"),
])
def test_a_size_below_one_is_refused(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_ray_reserves_a_bundle_per_rank_sharing_the_workers_cpus():
    placement = PoolPlacement(cpus=2.0, gpus=1.0, memory_bytes=8 << 30, resource="pdserve_decode", ranks=2)
    assert placement.bundle() == {"CPU": 1.0, "GPU": 1.0, "memory": 4 << 30, "pdserve_decode": 0.5}
    assert PoolPlacement(cpus=2.0).bundle() == {"CPU": 2.0}
    # Bundle 0 (rank 0's actor) reserves both ranks' GPUs: the rank it starts inherits its
    # CUDA_VISIBLE_DEVICES and takes device 1 of them.
    assert placement.bundles() == [{"CPU": 1.0, "GPU": 2.0, "memory": 4 << 30, "pdserve_decode": 0.5},
                                   {"CPU": 1.0, "memory": 4 << 30, "pdserve_decode": 0.5}]
    assert actor_options(placement, None)["num_gpus"] == 2.0
    with pytest.raises(ValueError, match=r"gpus_per_worker x tensor-parallel size.*0.75 x 2"):
        PoolPlacement(gpus=0.75, ranks=2)


def plain_worker(role, argv):
    from pdserve.cluster import worker_cli

    parser = argparse.ArgumentParser()
    add_arguments(parser, worker_cli.worker_settings())
    args = parser.parse_args(["--role", role, "--router-admin", "127.0.0.1:1", *argv])
    return worker_cli.worker_config(worker_cli.settings(args, environ={}))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_plain_worker_checksums_for_its_readers_tp(role):
    """``pdserve worker --reader-tp``: what ``pdserve serve`` gives each pool from the other's size."""
    assert plain_worker(role, []).reader_tp == 1
    assert plain_worker(role, ["--reader-tp", "4", "--tensor-parallel-size", "2"]).reader_tp == 4
    assert plain_worker(role, ["--tensor-parallel-size", "4", "--reader-tp", "2"]).reader_tp == 2


@pytest.mark.parametrize("argv, message", [
    (["--reader-tp", "3", "--tensor-parallel-size", "2"],
     "reader_tp: 3 (--reader-tp) and tensor_parallel_size 2 (--tensor-parallel-size) must divide one another"),
    (["--reader-tp", "0"], "--reader-tp: reader_tp must be at least 1, got 0"),
])
def test_a_reader_tp_the_kv_cannot_move_to_is_refused_naming_the_flag(argv, message):
    with pytest.raises(SettingsError) as exc:
        plain_worker("decode", argv)
    assert str(exc.value).startswith(message)

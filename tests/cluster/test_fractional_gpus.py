"""One GPU, two roles (issue 26): ``--gpus-per-worker 0.5`` reaches Ray's placement as half
a GPU per worker, so a host with one GPU places 1 prefill + 1 decode worker; a share Ray
cannot place (1.5 GPUs) is refused when the settings are read, naming the setting.

What is checked is the spec Ray receives (bundle and actor options), read without starting
Ray; that Ray packs two 0.5 bundles onto one GPU is Ray's documented fractional-GPU rule,
and the two workers sharing that GPU never ran here."""

import argparse

import pytest

from pdserve.cluster.placement import PoolPlacement, actor_options
from pdserve.cluster.serve_config import _placement
from pdserve.cluster.settings import SettingsError, add_arguments, resolve


def _values(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(argv), environ={})


def _one_gpu_node_holds(bundles) -> bool:
    return sum(b.get("GPU", 0.0) for b in bundles) <= 1.0


def test_half_a_gpu_each_puts_both_roles_on_one_gpu():
    v = _values(["--gpus-per-worker", "0.5"])
    bundles = [_placement(v.ray, pool, lambda: 1.0).bundle() for pool in ("prefill", "decode")]
    assert [b["GPU"] for b in bundles] == [0.5, 0.5]
    assert _one_gpu_node_holds(bundles)


def test_the_default_on_a_cuda_host_is_a_whole_gpu_each():
    """Why the setting is needed: by default each worker reserves a whole GPU, and a one-GPU
    host cannot place the second."""
    v = _values([])
    bundles = [_placement(v.ray, pool, lambda: 1.0).bundle() for pool in ("prefill", "decode")]
    assert not _one_gpu_node_holds(bundles)


def test_the_actor_asks_ray_for_the_same_fraction():
    options = actor_options(PoolPlacement(gpus=0.5), pg=None)
    assert options["num_gpus"] == 0.5


@pytest.mark.parametrize("gpus", [0.25, 1.0, 2.0])
def test_fractions_and_whole_gpus_are_accepted(gpus):
    assert PoolPlacement(gpus=gpus).bundle()["GPU"] == gpus


def test_a_share_ray_cannot_place_names_the_setting():
    v = _values(["--gpus-per-worker", "1.5"])
    with pytest.raises(SettingsError, match="gpus_per_worker .*at most 1.* whole number.*1.5"):
        _placement(v.ray, "prefill", lambda: 1.0)

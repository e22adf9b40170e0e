"""What a pdserve worker reserves in Ray is what a KubeRay worker group's node offers: each
pool's bundle fits one pod of its own group and no pod of the other, so a pending worker makes
Ray's autoscaler add a pod of the right group (deploy/k8s/overlays/kuberay)."""

import json

from pdserve.cluster.placement import PoolPlacement
from tests.deploy.manifests import named
from tests.helpers.deploy_commands import pdserve_containers, settings_of, with_mounted_files

GIB = 1 << 30


def test_a_bundle_names_everything_a_worker_uses():
    placement = PoolPlacement(cpus=8, gpus=1, memory_bytes=40 * GIB, resource="pdserve_decode")
    assert placement.bundle() == {"CPU": 8, "GPU": 1, "memory": 40 * GIB, "pdserve_decode": 1.0}
    assert PoolPlacement().bundle() == {"CPU": 0.01}  # one machine: bookkeeping only


def offered(group: dict) -> dict[str, float]:
    """What one pod of a worker group offers Ray, as `ray start` on it announces."""
    params, container = group["rayStartParams"], group["template"]["spec"]["containers"][0]
    out = {"CPU": float(container["resources"]["requests"]["cpu"]), "GPU": float(params["num-gpus"])}
    out.update(json.loads(json.loads(params["resources"])))
    return out


def fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in bundle.items() if k != "memory")


def test_each_pools_workers_fit_only_their_own_group(monkeypatch, tmp_path):
    from pdserve.cluster.serve_config import _placement

    [(_, template, container, argv)] = list(pdserve_containers("kuberay"))
    _, values = settings_of(with_mounted_files(argv, template, "kuberay", tmp_path), {}, monkeypatch)
    groups = {g["groupName"]: offered(g) for g in named("kuberay", "RayCluster", "pdserve")["spec"]["workerGroupSpecs"]}
    for pool in ("prefill", "decode"):
        bundle = _placement(values.ray, pool, lambda: 0.0).bundle()
        assert bundle.get(f"pdserve_{pool}") == 1.0 and bundle["GPU"] == 1
        assert fits(bundle, groups[pool]), (pool, bundle, groups[pool])
        other = "decode" if pool == "prefill" else "prefill"
        assert not fits(bundle, groups[other]), f"a {pool} worker would fit a {other} pod"

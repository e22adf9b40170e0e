"""Every object of every overlay fits its schema, offline: Kubernetes' OpenAPI schemas for the
core kinds, the checked-in KubeRay, KEDA and Prometheus Operator CRDs for the rest. A
misspelt field name fails, which is what these tests are for."""

import copy

import pytest

from tests.deploy.manifests import OVERLAYS, SchemaError, crd_validators, named, render, validate


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_fits_its_schema(overlay):
    kinds = set()
    for obj in render(overlay):
        try:
            validate(obj)
        except SchemaError as exc:
            pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']}: {exc}")
        kinds.add(obj["kind"])
    assert {"Namespace", "PersistentVolumeClaim", "Secret", "ConfigMap", "Service", "NetworkPolicy"} <= kinds


def test_every_custom_resource_has_a_checked_in_schema():
    known = set(crd_validators())
    for overlay in OVERLAYS:
        for obj in render(overlay):
            if "." in obj["apiVersion"].split("/")[0] and not obj["apiVersion"].startswith(
                    ("apps/", "networking.k8s.io/", "policy/", "batch/")):
                assert (obj["apiVersion"], obj["kind"]) in known, f"{overlay}: no schema for {obj['kind']}"


def test_each_overlay_has_what_its_mode_needs():
    plain = {(o["kind"], o["metadata"]["name"]) for o in render("plain-k8s")}
    assert {("Deployment", "pdserve-router"), ("Deployment", "pdserve-prefill"), ("Deployment", "pdserve-decode"),
            ("ScaledObject", "pdserve-prefill"), ("ScaledObject", "pdserve-decode"),
            ("ServiceMonitor", "pdserve-router")} <= plain
    kuberay = {o["kind"] for o in render("kuberay")}
    assert "RayCluster" in kuberay and "Deployment" not in kuberay and "ScaledObject" not in kuberay
    cpu = {o["kind"] for o in render("cpu-dev")}  # applies on a bare cluster: no CRD kinds
    assert "Deployment" in cpu and not cpu & {"ScaledObject", "ServiceMonitor", "RayCluster"}


def _typo(obj: dict, path: list, wrong: str) -> dict:
    """``obj`` with the field at ``path`` renamed to ``wrong``."""
    bad = copy.deepcopy(obj)
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[wrong] = node.pop(path[-1])
    return bad


TYPOS = [
    ("plain-k8s", "Deployment", "pdserve-prefill", ["spec", "template", "spec", "terminationGracePeriodSeconds"],
     "terminationGracePeriodSecond"),
    ("plain-k8s", "Deployment", "pdserve-decode", ["spec", "template", "spec", "containers", 0, "readinessProbe"],
     "readynessProbe"),
    ("plain-k8s", "Service", "pdserve-router", ["spec", "selector"], "selecter"),
    ("plain-k8s", "NetworkPolicy", "pdserve-internal-plane", ["spec", "ingress"], "ingres"),
    ("plain-k8s", "ScaledObject", "pdserve-prefill", ["spec", "minReplicaCount"], "minReplicas"),
    ("plain-k8s", "ScaledObject", "pdserve-decode", ["spec", "triggers", 0, "metricType"], "metricTyp"),
    ("plain-k8s", "ServiceMonitor", "pdserve-router", ["spec", "endpoints", 0, "path"], "paths"),
    ("kuberay", "RayCluster", "pdserve", ["spec", "enableInTreeAutoscaling"], "enableInTreeAutoscaler"),
    ("kuberay", "RayCluster", "pdserve", ["spec", "workerGroupSpecs", 1, "maxReplicas"], "maxReplica"),
    ("kuberay", "RayCluster", "pdserve", ["spec", "workerGroupSpecs", 0, "template", "spec", "nodeSelector"],
     "nodeselector"),
]


@pytest.mark.parametrize("overlay,kind,name,path,wrong", TYPOS, ids=[t[-1] for t in TYPOS])
def test_a_misspelt_field_fails(overlay, kind, name, path, wrong):
    obj = named(overlay, kind, name)
    validate(obj)
    with pytest.raises(SchemaError):
        validate(_typo(obj, path, wrong))

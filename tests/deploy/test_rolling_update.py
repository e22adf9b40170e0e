"""The plain Deployments roll as ``pdserve rollout`` does (docs/operations.md): a new pod is
ready before an old one goes, the router's old pod drops out of its Service before it stops
listening, and every pod's grace outlasts its preStop and its drain."""

import re

import pytest

from tests.deploy.manifests import named, objects
from tests.helpers.deploy_commands import environment, pdserve_containers, settings_of, with_mounted_files

PLAIN = ("plain-k8s", "cpu-dev")


@pytest.mark.parametrize("overlay", PLAIN)
def test_every_pool_surges_before_it_removes(overlay):
    deployments = objects(overlay, "Deployment")
    assert {d["metadata"]["name"] for d in deployments} >= {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    for d in deployments:
        strategy = d["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate", d["metadata"]["name"]
        assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}, d["metadata"]["name"]


@pytest.mark.parametrize("overlay", PLAIN)
def test_a_new_router_can_gather_its_workers_before_it_is_ready(overlay):
    assert named(overlay, "Service", "pdserve-router-internal")["spec"]["publishNotReadyAddresses"] is True


def _prestop_sleep(container: dict) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"][-1]
    found = re.fullmatch(r"sleep (\d+)", command)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("overlay", PLAIN)
def test_the_router_leaves_its_service_before_it_stops_listening(overlay, monkeypatch, tmp_path):
    for where, template, container, argv in pdserve_containers(overlay):
        _, values = settings_of(with_mounted_files(argv, template, overlay, tmp_path), environment(container),
                                monkeypatch)
        pause = _prestop_sleep(container)
        if values.role == "router":
            assert pause >= 5, f"{where}: no preStop sleep before SIGTERM (the endpoints need it to drop the pod)"
        grace = template["spec"]["terminationGracePeriodSeconds"]
        # a router serves one connection age more after SIGTERM, so that its clients leave first
        aging = 1.1 * values.plain.max_connection_age_seconds + 0.5 if values.role == "router" else 0.0
        assert grace > pause + aging + values.process.drain_grace_seconds + 10, where

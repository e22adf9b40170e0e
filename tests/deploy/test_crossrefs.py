"""The manifests agree with each other and with pdserve: every Service and ServiceMonitor
selects something, every probe hits a path the server on that port serves, every metric a
scaler queries is one pdserve exports, every flag, variable and config key is one the command
reads, and the grace period outlasts the drain. A rename on either side fails here."""

import json
import re
from types import SimpleNamespace

import pytest

from tests.deploy.manifests import OVERLAYS, container_ports, named, objects, pod_templates, render, selects
from tests.helpers.deploy_commands import environment, pdserve_containers, settings_of, with_mounted_files
from tests.helpers.exported_metrics import NAME, series_names


def port_settings(values) -> dict[str, int | None]:
    """Each port setting of a command's settings and its value (port: HTTP, as vllm); the last
    three are ``pdserve worker``'s own."""
    ports = {"port": values.api.port, "grpc_port": values.api.grpc_port}
    plain = getattr(values, "plain", None)  # WorkerSettings only
    if plain is not None:
        ports.update(internal_port=plain.internal_port, metrics_port=plain.metrics_port,
                     health_port=plain.health_port)
    return ports


# ---- Services and monitors -------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_selects_pods_that_have_its_ports(overlay):
    templates = pod_templates(overlay)
    for svc in objects(overlay, "Service"):
        chosen = [(w, t) for w, t in templates if selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert chosen, f"{overlay}: Service {svc['metadata']['name']} selects no pod"
        for where, template in chosen:
            ports = container_ports(template)
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert (target in ports) if isinstance(target, str) else (target in ports.values()), (
                    f"{overlay}: Service {svc['metadata']['name']} port {target} is not a port of {where}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_monitor_scrapes_a_service_port(overlay):
    services = objects(overlay, "Service")
    for monitor in objects(overlay, "ServiceMonitor"):
        chosen = [s for s in services if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert chosen, f"{overlay}: ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for svc in chosen:
            names = {p["name"] for p in svc["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_name_ports_their_pods_have(overlay):
    templates = pod_templates(overlay)
    for policy in objects(overlay, "NetworkPolicy"):
        chosen = [t for _, t in templates if selects(policy["spec"]["podSelector"]["matchLabels"],
                                                     t["metadata"]["labels"])]
        assert chosen, f"{overlay}: NetworkPolicy {policy['metadata']['name']} selects no pod"
        names = set().union(*(container_ports(t) for t in chosen))
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert port["port"] in names, f"{overlay}: {policy['metadata']['name']} names port {port['port']}"


def test_the_public_plane_admits_only_the_routers_public_ports():
    policy = named("plain-k8s", "NetworkPolicy", "pdserve-public-plane")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert [{p["port"] for p in rule["ports"]} for rule in policy["spec"]["ingress"]] == [{"grpc", "http"}]
    internal = named("plain-k8s", "NetworkPolicy", "pdserve-internal-plane")["spec"]["ingress"]
    assert all("ports" not in rule and rule["from"] for rule in internal)  # any port, pdserve's pods only


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_volumes_name_objects_of_the_overlay(overlay):
    have = {(o["kind"], o["metadata"]["name"]) for o in render(overlay)}
    for where, template in pod_templates(overlay):
        for volume in template["spec"].get("volumes", []):
            for key, kind, field in (("secret", "Secret", "secretName"), ("configMap", "ConfigMap", "name"),
                                     ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName")):
                if key in volume:
                    assert (kind, volume[key][field]) in have, f"{overlay}: {where} mounts a missing {kind}"


# ---- pdserve's side --------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_variable_and_config_key_is_one_pdserve_reads(overlay, monkeypatch, tmp_path):
    seen = 0
    for where, template, container, argv in pdserve_containers(overlay):
        table, values = settings_of(with_mounted_files(argv, template, overlay, tmp_path), environment(container),
                                    monkeypatch)
        known = {s.env for s in table}
        unknown = {name for name in environment(container) if name.startswith("PDSERVE_")} - known
        assert not unknown, f"{overlay}: {where} sets {sorted(unknown)}, which pdserve does not read"
        if values.autoscaling is not None:
            from pdserve.cluster.autoscaling import from_mapping

            from_mapping(values.autoscaling)
        seen += 1
    assert seen, f"{overlay}: no container runs pdserve"


def _served_paths(setting: str) -> set[str]:
    """The HTTP paths the server behind a port setting answers."""
    if setting == "port":
        from pdserve.router.http_api import OpenAIFront

        service = SimpleNamespace(limits=SimpleNamespace(requests=SimpleNamespace(max_body_bytes=1)))
        return {r.resource.canonical for r in OpenAIFront(service).app().router.routes()}
    if setting == "health_port":
        from pdserve.cluster.worker_cli import Health

        return set(Health.ROUTES)
    if setting == "metrics_port":
        return {"/metrics"}  # prometheus_client's exposition server
    return set()  # gRPC only


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_paths_the_server_on_that_port_serves(overlay, monkeypatch, tmp_path):
    probes = 0
    for where, template, container, argv in pdserve_containers(overlay):
        _, values = settings_of(with_mounted_files(argv, template, overlay, tmp_path), environment(container),
                                monkeypatch)
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        served_on = {port: s for s, port in port_settings(values).items() if port}
        for name, port in ports.items():
            if name in ("grpc", "http", "internal", "metrics", "health"):
                assert port in served_on, f"{overlay}: {where} port {name}={port}: pdserve serves nothing there"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            http = probe["httpGet"]
            port = ports[http["port"]] if isinstance(http["port"], str) else http["port"]
            assert http["path"] in _served_paths(served_on[port]), f"{overlay}: {where} {kind} {http}"
            probes += 1
    if overlay != "kuberay":  # KubeRay gives the Ray containers its own probes
        assert probes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_outlasts_the_drain(overlay, monkeypatch, tmp_path):
    for where, template, container, argv in pdserve_containers(overlay):
        _, values = settings_of(with_mounted_files(argv, template, overlay, tmp_path), environment(container),
                                monkeypatch)
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace > values.process.drain_grace_seconds + 10, f"{overlay}: {where}"
        assert "preStop" in container["lifecycle"], f"{overlay}: {where} has no preStop drain"


def test_plain_workers_join_the_router_internal_service(monkeypatch, tmp_path):
    internal = named("plain-k8s", "Service", "pdserve-router-internal")
    for where, template, container, argv in pdserve_containers("plain-k8s"):
        _, values = settings_of(with_mounted_files(argv, template, "plain-k8s", tmp_path), environment(container),
                                monkeypatch)
        if values.role == "router":
            assert values.plain.internal_port == internal["spec"]["ports"][0]["port"]
        else:
            assert values.plain.router_admin == f"pdserve-router-internal:{internal['spec']['ports'][0]['port']}"


def test_each_scaled_object_scales_its_pool_on_metrics_pdserve_exports(monkeypatch, tmp_path):
    exported = series_names()
    roles = {}
    for where, template, container, argv in pdserve_containers("plain-k8s"):
        _, values = settings_of(with_mounted_files(argv, template, "plain-k8s", tmp_path), environment(container),
                                monkeypatch)
        roles[where.split("/")[1]] = values.role
    scaled = set()
    for so in objects("plain-k8s", "ScaledObject"):
        role = roles[so["spec"]["scaleTargetRef"]["name"]]
        for trigger in so["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            assert NAME.findall(query), query
            assert set(NAME.findall(query)) <= exported, f"{query}: not exported by pdserve/wire/metrics.py"
            assert set(re.findall(r'pool="(\w+)"', query)) <= {role}, f"{so['metadata']['name']} reads another pool"
        scaled.add(role)
    assert scaled == {"prefill", "decode"}


def test_ray_worker_groups_offer_what_pdserve_workers_reserve(monkeypatch, tmp_path):
    cluster = named("kuberay", "RayCluster", "pdserve")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no worker on the head
    [(_, template, container, argv)] = list(pdserve_containers("kuberay"))
    _, values = settings_of(with_mounted_files(argv, template, "kuberay", tmp_path), environment(container),
                            monkeypatch)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for pool, group in groups.items():
        offered = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert offered == {values.ray.resource(pool): 1}, pool
        assert float(group["rayStartParams"]["num-gpus"]) == values.ray.gpus_per_worker
        resources = group["template"]["spec"]["containers"][0]["resources"]
        assert float(resources["limits"]["nvidia.com/gpu"]) == values.ray.gpus_per_worker
        assert float(resources["requests"]["cpu"]) >= values.ray.cpus_per_worker
        assert 1 <= group["minReplicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["nodeSelector"]["pdserve.dev/node-pool"] == pool

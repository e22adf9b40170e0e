"""The dashboard and the scrape config against a real Prometheus (Debian's ``prometheus``
package) scraping a live cluster: deploy/prometheus/prometheus.yml finds the router and, by
HTTP service discovery at ``/metrics/targets``, every worker; then every query of every
dashboard panel returns data through Prometheus' query API.

The config is used as shipped, with three test-only changes: the router's address (the test
cluster listens on a free port, not 8000) and 1 s scrape and discovery intervals instead of
5 s and 15 s. Grafana's variables are replaced as Grafana would for "All".
"""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from pdserve.cluster.autoscaling import from_mapping
from pdserve.cluster.autoscaling.budget import BudgetConfig
from pdserve.engine.config import KVTierConfig, SpeculativeConfig
from tests.clusters import cluster_config, running_cluster
from tests.helpers.exported_metrics import DEPLOY, graph_panels

pytestmark = pytest.mark.slow

# on PATH, or the one `make` unpacks from Debian's package into the venv
PROMETHEUS = shutil.which("prometheus") or shutil.which("prometheus", path=os.path.dirname(sys.executable))
VARIABLES = {"$__rate_interval": "30s", "$model_name": ".*", "$pool": ".*", "$instance": ".*"}


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_for(router: str) -> dict:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            static["targets"] = [router]
        for sd in job.get("http_sd_configs", []):
            sd["url"] = f"http://{router}/metrics/targets"
            sd["refresh_interval"] = "1s"
    return config


def _wait(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except (OSError, ValueError):
            got = None
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Autoscaling pinned at one worker per pool: nothing scales, but the controller reports
    # each pool's signal target, which the dashboard plots. Elastic roles with the budget
    # policy, which has nothing to move with one worker a pool: its pressures are exported.
    # The decode pool speculates (ngram), so the dashboard's speculative-decoding row has series;
    # both pools share a KV tier (a directory of this test's), so the KV tier row has them too.
    pinned = {"min_replicas": 1, "max_replicas": 1}
    config = cluster_config(kv_mib=64, router_poll_s=0.2, elastic_roles=True, role_budget=BudgetConfig(),
                            autoscaling=from_mapping({"prefill": pinned, "decode": pinned}))
    tier = KVTierConfig(offload_bytes=64 << 20, offload_dir=str(tmp_path_factory.mktemp("kv-tier")))
    config = dataclasses.replace(config, prefill_engine=dataclasses.replace(config.engine, kv_tier=tier),
                                 decode_engine=dataclasses.replace(config.engine, speculative=SpeculativeConfig(),
                                                                   kv_tier=tier))
    with running_cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (make unpacks Debian's into .venv; or apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(_config_for(cluster.http_address)))
    address = f"127.0.0.1:{_free_port()}"
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address={address}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: urllib.request.urlopen(f"http://{address}/-/ready", timeout=2).status == 200, 30,
              "Prometheus to start")
        yield f"http://{address}"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _up_targets(prom: str) -> dict[str, list[dict]]:
    active = _get(f"{prom}/api/v1/targets?state=active")["data"]["activeTargets"]
    jobs: dict[str, list[dict]] = {}
    for t in active:
        if t["health"] == "up":
            jobs.setdefault(t["labels"]["job"], []).append(t["labels"])
    return jobs


def test_every_dashboard_query_returns_data_from_a_live_cluster(cluster, prometheus):
    # Each target is up from its own first scrape on: wait for all three, not only the workers.
    jobs = _wait(lambda: (j := _up_targets(prometheus)) and len(j.get("pdserve-workers", [])) == 2
                 and j.get("pdserve-router") and j, 30, "the router and both workers up in Prometheus")
    assert len(jobs["pdserve-router"]) == 1
    assert sorted((w["pool"], w["worker"]) for w in jobs["pdserve-workers"]) == [("decode", "decode-0"),
                                                                                 ("prefill", "prefill-0")]
    api = f"http://{cluster.http_address}/v1/completions"
    prompt = "The tides rise and fall twice a day because the moon pulls on the oceans of the earth, and"
    for _ in range(2):  # the second is a prefix-cache hit
        assert _post(api, {"model": "smollm2", "prompt": prompt, "max_tokens": 4}) == 200
    # A request the router gives up on: its 1 ms deadline passes while it is routed.
    assert _post(api, {"prompt": prompt + " then", "max_tokens": 64}, {"X-Request-Timeout": "0.001"}) >= 400
    # Until every query has data (a rate needs two scrapes after the traffic, 1 s apart), not a
    # fixed wait: at most 30 s.
    deadline = time.monotonic() + 30
    while (empty := queries_without_data(prometheus)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not empty, "queries without data:\n" + "\n".join(empty)


def queries_without_data(prometheus: str) -> list[str]:
    """Each dashboard panel's query (Grafana's variables replaced) that Prometheus answers with
    no series, as "title: expression"; a query Prometheus refuses fails the test."""
    empty = []
    for panel in graph_panels(json.loads((DEPLOY / "grafana" / "pdserve-dashboard.json").read_text())):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            result = _get(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            assert result["status"] == "success", (panel["title"], expr, result)
            if not result["data"]["result"]:
                empty.append(f"{panel['title']}: {expr}")
    return empty

"""The Grafana dashboard and the Prometheus config in deploy/ query only metrics pdserve
exports: renaming a metric or mistyping a query fails here, not on someone's screen."""

import importlib.util
import json
import re

import jsonschema
import pytest
import yaml

from tests.helpers.exported_metrics import DEPLOY, NAME, graph_panels, series_names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "pdserve-dashboard.json").read_text())


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in graph_panels(dashboard) for t in p["targets"]]


def test_the_dashboard_is_a_grafana_dashboard(dashboard):
    """Checked against deploy/grafana/dashboard.schema.json: Grafana's dashboard JSON model,
    written down in the repository (no package ships Grafana's schema as JSON Schema)."""
    schema = json.loads((DEPLOY / "grafana" / "dashboard.schema.json").read_text())
    jsonschema.validate(dashboard, schema)
    bad = json.loads(json.dumps(dashboard))
    bad["panels"][1]["gridPos"]["w"] = 30  # wider than Grafana's 24 columns: the schema must say no
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert dashboard["__inputs"] == [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "",
                                      "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}]
    assert {"model_name", "pool", "instance"} <= variables.keys()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in graph_panels(dashboard):
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys(), p["title"]
        assert p["targets"] and all(t["expr"].strip() and t["refId"] for t in p["targets"]), p["title"]


def test_the_dashboard_file_is_what_its_generator_writes(dashboard):
    spec = importlib.util.spec_from_file_location("dashboard", DEPLOY / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert dashboard == json.loads(module.render()), "run python deploy/grafana/dashboard.py"


def test_each_pools_scaling_signal_is_plotted_with_its_target(dashboard):
    by_title = {p["title"]: [t["expr"] for t in p["targets"]] for p in graph_panels(dashboard)}
    for pool, signal in (("prefill", "worker_num_waiting_prompt_tokens"), ("decode", "worker_kv_cache_usage_perc")):
        (title,) = [t for t in by_title if t.startswith(f"{pool.capitalize()} scaling signal")]
        assert any(signal in e and f'pool="{pool}"' in e for e in by_title[title]), title
        assert f'max(pdserve:autoscaler_signal_target{{pool="{pool}"}})' in by_title[title], title


def test_every_query_names_only_exported_series(dashboard):
    exported = series_names()
    for expr in exprs(dashboard):
        assert NAME.findall(expr), expr
        unknown = set(NAME.findall(expr)) - exported
        assert not unknown, f"{expr}: {sorted(unknown)} not exported by pdserve/wire/metrics.py"
        assert expr.count("(") == expr.count(")"), expr


def test_the_dashboard_shows_what_an_operator_needs(dashboard):
    used = {n for e in exprs(dashboard) for n in NAME.findall(e)}
    for name in ("pdserve:time_to_first_token_seconds_bucket", "pdserve:inter_token_latency_seconds_bucket",
                 "pdserve:generation_tokens_total", "pdserve:request_success_total", "pdserve:num_requests_running",
                 "pdserve:num_requests_waiting", "pdserve:kv_cache_usage_perc", "pdserve:kv_transfer_bytes_total",
                 "pdserve:kv_transfer_failures_total", "pdserve:prefix_cache_hits_total",
                 "pdserve:prefix_cache_queries_total", "pdserve:pool_replicas", "pdserve:autoscaler_desired_replicas",
                 "pdserve:request_prompt_tokens_bucket", "pdserve:request_generation_tokens_bucket",
                 "pdserve:num_preemptions_total", "pdserve:worker_kv_transfer_seconds_bucket",
                 "pdserve:worker_kv_transfer_bytes_bucket", "pdserve:worker_kv_transfer_descriptors_bucket",
                 "pdserve:worker_num_waiting_prompt_tokens", "pdserve:autoscaler_signal_target",
                 "pdserve:role_changes_total", "pdserve:role_switch_seconds_bucket", "pdserve:role_budget_pressure",
                 "pdserve:role_switch_streams_handed_over_total", "pdserve:role_switch_leases_left_total",
                 "pdserve:mixed_workers"):
        assert name in used, name
    quantiles = {float(q) for e in exprs(dashboard) if "time_to_first_token" in e
                 for q in re.findall(r"histogram_quantile\(([0-9.]+)", e)}
    assert quantiles == {0.5, 0.9, 0.99}


def test_prometheus_scrapes_the_router_and_discovers_the_workers_through_it():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"pdserve-router", "pdserve-workers"}
    router = jobs["pdserve-router"]
    assert router.get("metrics_path", "/metrics") == "/metrics"
    assert router["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]
    workers = jobs["pdserve-workers"]
    assert workers["http_sd_configs"][0]["url"] == "http://127.0.0.1:8000/metrics/targets"
    assert workers["honor_labels"] is True  # targets and samples both carry pool and worker

"""The metric series pdserve exports and the Grafana dashboard's panels in deploy/: what the
dashboard, the Prometheus config and the Kubernetes scalers may query (tests/metrics,
tests/deploy)."""

import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.wire import metrics, worker_metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = re.compile(r"pdserve:[A-Za-z0-9_:]+")
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def series_names() -> set[str]:
    """Every series name pdserve exports, e.g. ``pdserve:x_seconds_bucket``, ``pdserve:y_total``."""
    text = metrics.render()[0].decode() + generate_latest(worker_metrics.WORKER_REGISTRY).decode()
    return {f.name + suffix for f in text_string_to_metric_families(text) for suffix in SUFFIXES[f.type]}


def graph_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out += p.get("panels", []) if p["type"] == "row" else [p]
    return out

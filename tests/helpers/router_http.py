"""A served router's HTTP endpoints read with urllib: a page, /health until it is 200, and the
conditional-disaggregation decisions in /metrics (tests/serving)."""

import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def wait_healthy(http_address: str, timeout_s: float = 30.0) -> None:
    """/health turns 200 once the router's first stats poll saw a ready worker."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            get(f"http://{http_address}/health")
            return
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and time.monotonic() < deadline, f"/health still {exc.code}"
            time.sleep(0.2)


def decisions(http_address: str) -> dict[tuple[str, str], float]:
    """The router's ``local_prefill_decisions_total`` by (decision, reason)."""
    out = {}
    for family in text_string_to_metric_families(get(f"http://{http_address}/metrics")):
        for s in family.samples:
            if s.name == "pdserve:local_prefill_decisions_total":
                assert s.labels["model_name"] == "smollm2", s
                out[(s.labels["decision"], s.labels["reason"])] = s.value
    return out

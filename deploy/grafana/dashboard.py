"""Writes ``pdserve-dashboard.json``, the Grafana dashboard (run ``python
deploy/grafana/dashboard.py``; tests/metrics/test_deploy.py checks the file is fresh).

Panels are listed row by row as (title, unit, description, [(PromQL, legend), ...]). Router
families are filtered by ``$model_name``, worker families by ``$pool`` and ``$instance``
(the scrape target of one worker). ``__inputs`` makes Grafana's import ask for the
Prometheus data source; with file provisioning the ``DS_PROMETHEUS`` variable picks it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "pdserve-dashboard.json"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RATE = "$__rate_interval"
M = '{model_name=~"$model_name"}'  # router request families
W = '{pool=~"$pool", instance=~"$instance"}'  # worker families


def _quantiles(metric: str, qs=(0.5, 0.9, 0.99), by: str = "le") -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{M}[{RATE}])))", f"p{round(q * 100)}")
            for q in qs]


def _worker_quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, backend) (rate({metric}_bucket{W}[{RATE}])))",
             f"p{round(q * 100)} {{{{backend}}}}") for q in (0.5, 0.9)]


ROWS = [
    ("Latency (router)", [
        ("Time to first token", "s", "Request start at the router to the first token sent.",
         _quantiles("pdserve:time_to_first_token_seconds")),
        ("Inter-token latency", "s", "Time between two token batches sent to a client.",
         _quantiles("pdserve:inter_token_latency_seconds")),
        ("End-to-end latency", "s", "Request start to finish, aborts included.",
         _quantiles("pdserve:e2e_request_latency_seconds")),
        ("Request phases (p90)", "s", "Queue (router admission + prefill worker), prefill compute, KV transfer, decode.",
         [(e, name) for (e, _), name in zip(
             [_quantiles(m, (0.9,))[0] for m in ("pdserve:request_queue_time_seconds",
                                                 "pdserve:request_prefill_time_seconds",
                                                 "pdserve:kv_transfer_seconds", "pdserve:request_decode_time_seconds")],
             ("queue", "prefill", "kv transfer", "decode"))]),
    ]),
    ("Throughput", [
        ("Tokens per second", "short", "Prompt tokens prefilled and tokens sent to clients.",
         [(f"sum(rate(pdserve:generation_tokens_total{M}[{RATE}]))", "generated"),
          (f"sum(rate(pdserve:prompt_tokens_total{M}[{RATE}]))", "prompt")]),
        ("Requests per second", "reqps", "Finished requests by finish reason, failures by gRPC status, retries "
         "and migrations.",
         [(f"sum by (finished_reason) (rate(pdserve:request_success_total{M}[{RATE}]))", "{{finished_reason}}"),
          (f"sum by (code) (rate(pdserve:request_failures_total{M}[{RATE}]))", "failed {{code}}"),
          (f"sum(rate(pdserve:request_retries_total{M}[{RATE}]))", "retries"),
          (f"sum(rate(pdserve:request_migrations_total{M}[{RATE}]))", "migrations")]),
        ("Request length (p50, p90)", "short", "Prompt tokens and tokens generated per request.",
         [(e, f"prompt {legend}") for e, legend in _quantiles("pdserve:request_prompt_tokens", (0.5, 0.9))]
         + [(e, f"generated {legend}") for e, legend in _quantiles("pdserve:request_generation_tokens", (0.5, 0.9))]),
    ]),
    ("Autoscaling", [
        ("Prefill scaling signal: queued prompt tokens per worker", "short",
         "The prefill autoscaler's primary signal and its target (absent without autoscaling).",
         [('avg(pdserve:worker_num_waiting_prompt_tokens{pool="prefill"})', "queued per worker"),
          ('max(pdserve:autoscaler_signal_target{pool="prefill"})', "target")]),
        ("Decode scaling signal: KV cache usage per worker", "percentunit",
         "The decode autoscaler's primary signal and its target (absent without autoscaling).",
         [('avg(pdserve:worker_kv_cache_usage_perc{pool="decode"})', "usage per worker"),
          ('max(pdserve:autoscaler_signal_target{pool="decode"})', "target")]),
        ("Replicas per pool", "short", "Healthy workers and the autoscaler's desired count.",
         [('max by (pool) (pdserve:pool_replicas{pool=~"$pool"})', "{{pool}} healthy"),
          ('max by (pool) (pdserve:autoscaler_desired_replicas{pool=~"$pool"})', "{{pool}} desired")]),
    ]),
    ("Elastic roles", [
        ("Workers per role", "short", "Each pool's healthy workers: with elastic roles (--elastic-roles), the role "
         "timeline, which moves as workers switch. Mixed: those of the decode pool that prefill the streams they "
         "take.",
         [('max by (pool) (pdserve:pool_replicas{pool=~"$pool"})', "{{pool}}"),
          ("max(pdserve:mixed_workers)", "of decode: mixed")]),
        ("Role budget pressure", "short", "The budget policy's pressure of each pool (--role-budget): the largest "
         "of its signals over their targets; a pool above 1 asks the other for a worker.",
         [('max by (pool) (pdserve:role_budget_pressure{pool=~"$pool"})', "{{pool}}")]),
        ("Role changes", "short", "Switches completed per window, by direction and reason (manual, or the pool "
         "whose pressure asked for the worker).",
         [(f"sum by (from_role, to_role, reason) (increase(pdserve:role_changes_total[{RATE}]))",
           "{{from_role}} -> {{to_role}} ({{reason}})")]),
        ("Role switch time", "s", "From the controller's decision until the worker serves its new role.",
         [(f"histogram_quantile({q}, sum by (le, to_role) (rate(pdserve:role_switch_seconds_bucket[{RATE}])))",
           f"p{round(q * 100)} to {{{{to_role}}}}") for q in (0.5, 0.99)]),
        ("Work moved by role switches", "short", "Decode streams handed over past a switch's grace (and of them "
         "those that moved with their KV, no re-prefill), and held KV left to its lease when the new role "
         "opened, per window.",
         [(f"sum by (from_role) (increase(pdserve:role_switch_streams_handed_over_total[{RATE}]))",
           "streams handed over from {{from_role}}"),
          (f"sum by (from_role) (increase(pdserve:role_switch_streams_kv_moved_total[{RATE}]))",
           "of them moved with their KV, from {{from_role}}"),
          (f"sum by (from_role) (increase(pdserve:role_switch_leases_left_total[{RATE}]))",
           "leases left by {{from_role}}")]),
    ]),
    ("Pools and workers", [
        ("Requests per pool", "short", "Running and waiting requests, summed over each pool's workers.",
         [('max by (pool) (pdserve:num_requests_running{pool=~"$pool"})', "{{pool}} running"),
          ('max by (pool) (pdserve:num_requests_waiting{pool=~"$pool"})', "{{pool}} waiting")]),
        ("KV cache usage per pool", "percentunit", "Used KV blocks over the pool's total.",
         [('max by (pool) (pdserve:kv_cache_usage_perc{pool=~"$pool"})', "{{pool}}")]),
        ("KV cache usage per worker", "percentunit", "", [(f"pdserve:worker_kv_cache_usage_perc{W}", "{{worker}}")]),
        ("Requests per worker", "short", "Running, waiting and held-KV prompts per worker.",
         [(f"pdserve:worker_num_requests_running{W}", "{{worker}} running"),
          (f"pdserve:worker_num_requests_waiting{W}", "{{worker}} waiting"),
          (f"pdserve:worker_num_held_leases{W}", "{{worker}} held")]),
        ("Model tokens per second per worker", "short", "Tokens run through the model.",
         [(f"rate(pdserve:forward_tokens_total{W}[{RATE}])", "{{worker}}")]),
        ("Preemptions per worker", "short", "Sequences whose KV was freed to make room, per second.",
         [(f"rate(pdserve:num_preemptions_total{W}[{RATE}])", "{{worker}}")]),
    ]),
    ("Routing and conditional disaggregation", [
        ("Prefill routing decisions", "short",
         "Prefill workers chosen per second, by the rule that chose: cache (a prefix hit won), load, balance "
         "(queues imbalanced: shortest queue), round_robin, only (one candidate).",
         [(f"sum by (reason) (rate(pdserve:routing_decisions_total{M}[{RATE}]))", "{{reason}}")]),
        ("Prefix overlap of the chosen prefill worker", "short",
         "Prompt tokens the chosen worker caches, per the router's KV index.",
         _quantiles("pdserve:routing_prefix_overlap_tokens")),
        ("Who prefilled", "short",
         "Attempts per second prefilled by their decode worker (local) or by the prefill pool (remote), by the "
         "local-prefill rule's reason.",
         [(f"sum by (decision, reason) (rate(pdserve:local_prefill_decisions_total{M}[{RATE}]))",
           "{{decision}} {{reason}}")]),
        ("Local-prefill rule input: uncached prompt tokens (p90)", "short",
         "The uncached prompt tokens the rule saw, by its decision (compare with --local-prefill-max-tokens).",
         [(f"histogram_quantile(0.9, sum by (le, decision) (rate(pdserve:local_prefill_uncached_tokens_bucket{M}"
           f"[{RATE}])))", "{{decision}}")]),
    ]),
    ("KV transfer and prefix cache", [
        ("KV transfer rate", "Bps", "KV bytes read by each decode worker.",
         [(f"sum by (worker) (rate(pdserve:kv_transfer_bytes_total{W}[{RATE}]))", "{{worker}}")]),
        ("KV transfers per second", "short", "",
         [(f"sum by (worker) (rate(pdserve:kv_transfers_total{W}[{RATE}]))", "{{worker}}")]),
        ("KV transfer failures", "short",
         "Failed reads (of which: bytes that did not match the holder's checksums), KV refused unread for want of "
         "checksums, and leases that expired unread.",
         [(f"sum by (worker) (rate(pdserve:kv_transfer_failures_total{W}[{RATE}]))", "{{worker}} failed"),
          (f"sum by (worker) (rate(pdserve:kv_verify_failures_total{W}[{RATE}]))", "{{worker}} checksum mismatch"),
          (f"sum by (worker) (rate(pdserve:kv_unverified_refused_total{W}[{RATE}]))", "{{worker}} no checksums"),
          (f"sum by (worker) (rate(pdserve:kv_leases_expired_total{W}[{RATE}]))", "{{worker}} expired")]),
        ("KV transfer time per read", "s", "One read, start to completion, by backend.",
         _worker_quantiles("pdserve:worker_kv_transfer_seconds")),
        ("KV bytes per read", "bytes", "", _worker_quantiles("pdserve:worker_kv_transfer_bytes")),
        ("KV descriptors per read", "short", "One descriptor per KV block.",
         _worker_quantiles("pdserve:worker_kv_transfer_descriptors")),
        ("Prefix cache hit rate", "percentunit", "Prompt tokens found in the prefix cache over those looked up.",
         [(f"sum(rate(pdserve:prefix_cache_hits_total{W}[{RATE}])) / "
           f"sum(rate(pdserve:prefix_cache_queries_total{W}[{RATE}]))", "all"),
          (f"sum by (worker) (rate(pdserve:prefix_cache_hits_total{W}[{RATE}])) / "
           f"sum by (worker) (rate(pdserve:prefix_cache_queries_total{W}[{RATE}]))", "{{worker}}")]),
    ]),
    ("Speculative decoding (--speculative-config)", [
        ("Speculative acceptance rate", "percentunit",
         "Proposed tokens the target kept, over those proposed (workers that decode with --speculative-config).",
         [(f"sum by (worker) (rate(pdserve:spec_decode_num_accepted_tokens_total{W}[{RATE}])) / "
           f"sum by (worker) (rate(pdserve:spec_decode_num_draft_tokens_total{W}[{RATE}]))", "{{worker}}")]),
        ("Mean accepted length", "short",
         "Tokens a speculating step makes per sequence: 1 (the target's own) + kept guesses per proposal.",
         [(f"1 + sum by (worker) (rate(pdserve:spec_decode_num_accepted_tokens_total{W}[{RATE}])) / "
           f"sum by (worker) (rate(pdserve:spec_decode_num_drafts_total{W}[{RATE}]))", "{{worker}}")]),
    ]),
    ("KV tier (--kv-offload-bytes)", [
        ("KV tier usage", "bytes",
         "Bytes each KV tier holds, against its bound; the workers of a host that share a tier report it alike.",
         [(f"max by (tier) (pdserve:kv_tier_bytes{W})", "{{tier}} used"),
          (f"max by (tier) (pdserve:kv_tier_capacity_bytes{W})", "{{tier}} bound")]),
        ("KV tier blocks moved", "short",
         "Prefix blocks per second each worker moved down on eviction, and brought back verified on a hit.",
         [(f"sum by (worker) (rate(pdserve:kv_tier_blocks_offloaded_total{W}[{RATE}]))", "{{worker}} down"),
          (f"sum by (worker) (rate(pdserve:kv_tier_blocks_loaded_total{W}[{RATE}]))", "{{worker}} back")]),
        ("Prefix tokens found in the KV tier", "percentunit",
         "Of the prompt tokens looked up, those found in the KV tier (the rest of the hit rate is KV memory's).",
         [(f"sum by (worker) (rate(pdserve:prefix_cache_tier_hits_total{W}[{RATE}])) / "
           f"sum by (worker) (rate(pdserve:prefix_cache_queries_total{W}[{RATE}]))", "{{worker}}")]),
        ("KV tier corrupt blocks", "short",
         "Blocks per second read back whose checksum or tokens did not match: deleted, and the prompt computed.",
         [(f"sum by (worker) (rate(pdserve:kv_tier_corrupt_blocks_total{W}[{RATE}]))", "{{worker}}")]),
    ]),
]


def _panel(pid: int, title: str, unit: str, description: str, queries, x: int, y: int) -> dict:
    overrides = [{"matcher": {"id": "byName", "options": "target"},
                  "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                                 {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}]
    return {
        "id": pid, "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}},
                        "overrides": overrides if any(legend == "target" for _, legend in queries) else []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i), "datasource": DS}
                    for i, (expr, legend) in enumerate(queries)],
    }


def _variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query, "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "options": [], "hide": 0, "sort": 1}


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, description, queries) in enumerate(row):
            panels.append(_panel(pid, title, unit, description, queries, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(row) + 1) // 2)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "__requires": [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "9.0.0"},
                       {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
                       {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""}],
        "title": "pdserve", "uid": "pdserve", "description": "Disaggregated prefill/decode serving: router and workers.",
        "tags": ["pdserve", "llm"], "editable": True, "schemaVersion": 39, "version": 1, "timezone": "",
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "graphTooltip": 1, "annotations": {"list": []},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": []},
            _variable("model_name", "Model", "label_values(pdserve:time_to_first_token_seconds_count, model_name)"),
            _variable("pool", "Pool", "label_values(pdserve:worker_num_requests_running, pool)"),
            _variable("instance", "Instance", 'label_values(pdserve:worker_num_requests_running{pool=~"$pool"}, instance)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")

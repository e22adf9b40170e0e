"""Stand-ins for `vllm bench serve` result files, for the serving benchmark's report and sweep
tests (tests/benchmarks)."""

from __future__ import annotations


def vllm_result(ttft: float, tpot: float, out_tok_s: float, completed: int = 32, failed: int = 0) -> dict:
    """The fields of a `vllm bench serve --save-result` file that benchmarks/serving_report.py
    reads (plus one it ignores)."""
    raw = {"duration": 20.0, "completed": completed, "failed": failed, "request_throughput": completed / 20.0,
           "output_throughput": out_tok_s, "total_token_throughput": 1.0}
    for metric, base in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2el", ttft + 63 * tpot)):
        raw[f"mean_{metric}_ms"] = base
        for p, scale in ((50, 1.0), (90, 1.5), (99, 2.0)):
            raw[f"p{p}_{metric}_ms"] = base * scale
    return raw

"""The serving sweep's arithmetic (benchmarks/serving_sweep_report.py) and its runs' shape
(benchmarks/serving_sweep.py), on fixed per-request data: attainment, the goodput rule and its
interpolation, failed and missing runs, the ratios, the table. No server starts."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.serving import parse_args
from benchmarks.serving_run import bench_cmd
from benchmarks.serving_sweep import best_vllm_dtype, rows_of, sweep_loads
from benchmarks.serving_sweep_report import attainment, goodput, markdown, plot, ratio, summarize, sweep_row
from tests.helpers.vllm_bench import vllm_result

SLO = {"ttft_ms": 2000.0, "tpot_ms": 100.0}


def detailed(reqs: list[tuple[float, float, int, str]]) -> dict:
    """A `vllm bench serve --save-detailed` result of (TTFT s, latency s, output tokens, error) per request."""
    raw = vllm_result(ttft=100.0, tpot=20.0, out_tok_s=50.0, completed=sum(1 for r in reqs if not r[3]))
    raw.update(ttfts=[r[0] for r in reqs], latencies=[r[1] for r in reqs], output_lens=[r[2] for r in reqs],
               errors=[r[3] for r in reqs], request_goodput=0.5)
    return raw


def test_attainment_counts_both_objectives_and_failed_requests_as_misses():
    raw = detailed([(1.0, 1.0 + 63 * 0.05, 64, ""),    # meets both
                    (2.0, 2.0 + 63 * 0.1, 64, ""),     # both exactly at the objectives: meets
                    (2.5, 2.5 + 63 * 0.05, 64, ""),    # TTFT over
                    (1.0, 1.0 + 63 * 0.2, 64, ""),     # TPOT over
                    (0.5, 0.5, 1, ""),                 # one token: TPOT 0, meets
                    (0.0, 0.0, 0, "connection reset")])  # failed: in the denominator, meets nothing
    assert attainment(raw, **SLO) == {"requests": 6, "met": 3, "failed": 1, "attainment": 0.5}


def test_attainment_needs_the_per_request_detail():
    with pytest.raises(ValueError, match="--save-detailed"):
        attainment(vllm_result(100.0, 20.0, 50.0), **SLO)


def rows(server: str, points: dict) -> list[dict]:
    return [{"server": server, "load": f"rate{r:g}", "rate": r, "attainment": a} for r, a in points.items()]


def test_goodput_is_the_highest_swept_rate_met_with_the_crossing_beside_it():
    g = goodput(rows("pdserve", {1.0: 0.95, 0.5: 1.0, 1.5: 0.5}))
    assert g["req_s"] == 1.0
    assert g["interpolated_req_s"] == pytest.approx(1.0 + 0.5 * (0.95 - 0.9) / (0.95 - 0.5), abs=1e-3)
    assert "1 req/s met 95%, 1.5 req/s 50%" == g["how"]


def test_a_pass_after_a_miss_does_not_count():
    assert goodput(rows("vllm", {0.5: 1.0, 1.0: 0.8, 1.5: 0.92}))["req_s"] == 0.5


def test_every_rate_met_is_a_lower_bound_and_none_met_is_zero():
    every = goodput(rows("pdserve", {0.5: 1.0, 1.0: 0.9}))
    assert (every["req_s"], every["interpolated_req_s"]) == (1.0, None) and "at least 1 req/s" in every["how"]
    none = goodput(rows("pdserve", {0.5: 0.4, 1.0: 0.1}))
    assert none["req_s"] == 0.0 and "below the lowest swept rate" in none["how"]


def test_a_run_without_a_result_stops_the_search_there():
    g = goodput(rows("pdserve", {0.5: 1.0, 1.0: None, 1.5: 1.0}))
    assert g["req_s"] == 0.5 and "1 req/s has no result" in g["how"]
    assert goodput(rows("pdserve", {0.5: None}))["req_s"] is None
    assert goodput([])["req_s"] is None


def test_ratio_is_none_where_a_side_is_missing_or_zero():
    assert ratio(1.5, 1.0) == 1.5
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def sweep_doc() -> dict:
    ours = [sweep_row("pdserve", f"rate{r:g}", r, 1000 * (i + 1), detailed([(t, t + 63 * 0.05, 64, "")] * 10), **SLO)
            for i, (r, t) in enumerate([(0.5, 0.5), (1.0, 1.0), (1.5, 3.0)])]
    peer = [sweep_row("vllm", f"rate{r:g}", r, 1000 * (i + 1), detailed([(t, t + 63 * 0.05, 64, "")] * 10), **SLO)
            for i, (r, t) in enumerate([(0.5, 0.5), (1.0, 2.5)])]
    peer.append({"server": "vllm", "load": "rate1.5", "rate": 1.5, "seed": 3000, "attainment": None,
                 "error": "vllm bench serve exited with 1"})
    sat = [sweep_row(s, "saturation", None, 4000, {**detailed([(1.0, 4.0, 64, "")] * 4), "request_throughput": q,
                                                   "output_throughput": 64 * q}, **SLO)
           for s, q in (("pdserve", 1.2), ("vllm", 1.0))]
    doc = {"slo": SLO, "servers_run": ["pdserve", "vllm"], "rows": ours + peer + sat,
           "machine": {"cpu_model": "test cpu", "kernel_path": "avx2"}}
    doc["summary"] = summarize(doc["rows"])
    return doc


def test_summary_goodput_saturation_and_ratios():
    doc = sweep_doc()
    s = doc["summary"]
    assert s["servers"]["pdserve"]["goodput"]["req_s"] == 1.0 and s["servers"]["vllm"]["goodput"]["req_s"] == 0.5
    assert s["servers"]["pdserve"]["saturation"]["req_s"] == 1.2
    assert s["ratios"] == {"goodput": 2.0, "saturation_req_s": 1.2, "saturation_output_tok_s": 1.2}


def test_the_table_shows_each_rate_both_servers_and_the_ratios(tmp_path):
    doc = sweep_doc()
    table = markdown(doc)
    assert "| 1 | 100% (10/10) | 100 / 200 | 20.0 / 40.0 | 40 | 0.50 |" in table  # pdserve at 1 req/s
    assert "| 1.5 | 0% (0/10)" in table and "no result (vllm bench serve exited with 1)" in table
    assert "goodput 2.00x, throughput at saturation 1.20x req/s, 1.20x output tok/s" in table
    doc["pdserve_layout"] = ["layout auto: 1P:1D predicted goodput 1.00 req/s", "layout auto: chose 1P:1D: why"]
    assert markdown(doc).endswith("pdserve's layout: layout auto: chose 1P:1D: why")
    plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def sweep_args(extra: list[str] = ()) -> argparse.Namespace:
    args = parse_args(["--sweep", "--rates", "1,0.5", "--sweep-prompts", "6", *extra])
    from benchmarks.serving_sweep import parse_rates

    args.rates = parse_rates(args.rates)
    return args


def test_each_rate_has_its_own_seed_after_a_warm_up_and_no_warm_up_requests():
    args = sweep_args()
    loads = sweep_loads(args)
    assert [l.name for l in loads] == ["warmup", "rate0.5", "rate1", "saturation"]
    assert [l.seed for l in loads] == [0, 1000, 2000, 3000] and {l.warmups for l in loads} == {0}
    cmd = bench_cmd(args, 8000, "smollm2", loads[2], args.out_dir / "r.json")
    assert cmd[cmd.index("--seed") + 1] == "2000" and cmd[cmd.index("--num-warmups") + 1] == "0"
    assert cmd[cmd.index("--goodput"):][:3] == ["--goodput", "ttft:2000", "tpot:100"]
    assert cmd[cmd.index("--request-rate") + 1] == "1" and cmd[cmd.index("--num-prompts") + 1] == "6"


def test_pdserve_starts_as_make_serve_unless_flags_are_given():
    from benchmarks.serving_run import pdserve_server

    assert "--layout" not in pdserve_server(sweep_args()).cmd
    assert pdserve_server(sweep_args(["--pdserve-flags", "--layout colocated"])).cmd[-2:] == ["--layout", "colocated"]


def test_vllm_runs_at_its_best_dtype_for_the_processor():
    assert best_vllm_dtype("avx2") == "float32" and best_vllm_dtype(None) == "float32"
    assert best_vllm_dtype("avx512_bf16") == best_vllm_dtype("amx") == "bfloat16"


def test_rows_of_a_server_that_failed_keep_what_it_measured(tmp_path):
    args = sweep_args(["--out-dir", str(tmp_path)])
    loads = sweep_loads(args)
    (tmp_path / "pdserve-rate0.5.json").write_text(json.dumps(detailed([(0.5, 1.0, 64, "")] * 3)))
    doc = {"servers_run": ["pdserve"], "errors": {"pdserve": "server exited"},
           "results": [{"server": "pdserve", "load": "rate0.5", "raw_result": "pdserve-rate0.5.json", "cpu": {}}]}
    got = rows_of(doc, args, loads)
    assert [(r["load"], r["attainment"]) for r in got] == [("rate0.5", 1.0), ("rate1", None), ("saturation", None)]
    assert got[1]["error"] == "server exited"


def test_a_share_just_under_the_target_never_prints_as_the_target():
    from benchmarks.serving_sweep_report import pct

    assert [pct(43 / 48), pct(1.0), pct(0.95), pct(47 / 48), pct(0.0)] == ["89.5%", "100%", "95%", "97.9%", "0%"]

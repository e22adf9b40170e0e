"""The serving benchmark's results: parsing `vllm bench serve` files, ratios, issue-9 targets,
the table, the plot and the py-spy summary (benchmarks/serving_report.py, benchmarks/serving_run.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.serving_report import (ResultError, compare, markdown, plot, profile_summary, record,
                                       targets)
from benchmarks.serving_run import LOADS, bench_cmd, new_doc
from tests.helpers.vllm_bench import vllm_result


def doc_with(rows: list[dict]) -> dict:
    args = argparse.Namespace(note="test", input_len=256, output_len=64, seed=0)
    doc = new_doc(args)
    doc["results"] = rows
    doc["ratios"] = compare(rows, list(doc["loads"]))
    doc["targets"] = targets(doc["ratios"])
    return doc


def test_record_reads_percentiles_and_throughput():
    row = record("pdserve", "rate2", vllm_result(ttft=100.0, tpot=20.0, out_tok_s=110.0, failed=1))
    assert row["ttft_ms"] == {"mean": 100.0, "p50": 100.0, "p90": 150.0, "p99": 200.0}
    assert row["e2el_ms"]["p50"] == 100.0 + 63 * 20.0
    assert (row["output_tok_s"], row["req_s"], row["completed"], row["failed"]) == (110.0, 1.6, 32, 1)


def test_record_names_the_missing_percentile_and_the_flags():
    raw = vllm_result(100.0, 20.0, 110.0)
    del raw["p90_itl_ms"]
    with pytest.raises(ResultError, match=r"pdserve/conc16.*'p90_itl_ms'.*--metric-percentiles 50,90,99"):
        record("pdserve", "conc16", raw)


def test_targets_met_and_missed():
    rows = [record("pdserve", "rate2", vllm_result(ttft=250.0, tpot=30.0, out_tok_s=100.0)),
            record("vllm", "rate2", vllm_result(ttft=100.0, tpot=35.0, out_tok_s=110.0)),
            record("pdserve", "conc16", vllm_result(ttft=900.0, tpot=40.0, out_tok_s=280.0)),
            record("vllm", "conc16", vllm_result(ttft=500.0, tpot=45.0, out_tok_s=300.0))]
    doc = doc_with(rows)
    assert doc["ratios"]["rate2"] == {"ttft_p50": 2.5, "tpot_p50": 0.857, "itl_p99": 0.857, "output_tok_s": 0.909}
    met = {(t["load"], t["ratio"]): t["met"] for t in doc["targets"]}
    assert met == {("rate2", "tpot_p50"): True, ("rate2", "ttft_p50"): False, ("rate2", "itl_p99"): False,
                   ("conc16", "output_tok_s"): False}
    table = markdown(doc)
    assert "| TPOT p50 at most vLLM's | 2 req/s, 32 prompts | 0.86x | ≤ 1x | **met** |" in table
    assert "| output tok/s at least vLLM's | concurrency 16, 48 prompts | 0.93x | ≥ 1x | **not met** |" in table
    assert table.startswith(f"Processor: {doc['machine']['cpu_model']}")
    assert f"kernel path {doc['machine']['kernel_path']}" in table


def test_a_load_with_failed_requests_is_not_compared():
    rows = [record("pdserve", "conc16", vllm_result(ttft=0.0, tpot=0.0, out_tok_s=0.0, completed=0, failed=48)),
            record("vllm", "conc16", vllm_result(ttft=500.0, tpot=45.0, out_tok_s=300.0))]
    doc = doc_with(rows)
    assert not rows[0]["valid"] and rows[1]["valid"]
    assert doc["ratios"]["conc16"]["output_tok_s"] is None
    assert [t["met"] for t in doc["targets"] if t["load"] == "conc16"] == [None]
    assert "| 0 / 48 |" in markdown(doc)


def test_one_server_only_leaves_ratios_and_targets_open(tmp_path):
    doc = doc_with([record("pdserve", "rate2", vllm_result(250.0, 30.0, 100.0))])
    assert doc["ratios"]["rate2"]["tpot_p50"] is None
    assert {t["met"] for t in doc["targets"]} == {None}
    assert "| n/a |" in markdown(doc)
    plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(doc)  # the whole document is plain JSON


def test_a_run_of_one_load_tables_only_its_targets():
    """`--loads rate2`: the concurrency-16 target was not measured, so it has no row (and no KeyError)."""
    args = argparse.Namespace(note="test", input_len=256, output_len=64, seed=0, loads=LOADS[:1])
    doc = new_doc(args)
    doc["results"] = [record("pdserve", "rate2", vllm_result(250.0, 30.0, 100.0)),
                      record("vllm", "rate2", vllm_result(100.0, 35.0, 110.0))]
    doc["ratios"] = compare(doc["results"], list(doc["loads"]))
    doc["targets"] = targets(doc["ratios"])
    table = markdown(doc)
    assert "| TPOT p50 at most vLLM's | 2 req/s, 32 prompts | 0.86x | ≤ 1x | **met** |" in table
    assert "output tok/s at least" not in table


def test_bench_command_per_load(tmp_path):
    args = argparse.Namespace(vllm_venv=tmp_path, hf_dir=tmp_path / "hf", input_len=256, output_len=64, seed=0,
                              warmups=1)
    rate2, conc16 = (bench_cmd(args, 8300, "m", load, tmp_path / f"{load.name}.json") for load in LOADS)
    assert rate2[rate2.index("--request-rate") + 1] == "2" and "--max-concurrency" not in rate2
    assert rate2[rate2.index("--num-prompts") + 1] == "32"
    assert conc16[conc16.index("--request-rate") + 1] == "inf"
    assert conc16[conc16.index("--max-concurrency") + 1] == "16"
    assert conc16[conc16.index("--num-prompts") + 1] == "48"
    for flag, value in (("--percentile-metrics", "ttft,tpot,itl,e2el"), ("--metric-percentiles", "50,90,99"),
                        ("--random-input-len", "256"), ("--random-output-len", "64"),
                        ("--result-filename", "conc16.json")):
        assert conc16[conc16.index(flag) + 1] == value
    assert "--ignore-eos" in conc16 and "--save-result" in conc16


def test_profile_summary_self_and_inclusive_over_busy_samples(tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text("main (a.py:1);step (e.py:5);mm (m.py:9) 6\n"
                   "main (a.py:1);step (e.py:5);attn (m.py:20) 3\n"
                   "main (a.py:1);poll (l.py:2) 1\n"
                   "main (a.py:1);loop (l.py:7);Condition.wait (threading.py:295) 10\n")
    s = profile_summary(raw)
    assert (s["samples"], s["waiting_share"]) == (20, 0.5)
    assert s["self"] == [("mm (m.py:9)", 0.6), ("attn (m.py:20)", 0.3), ("poll (l.py:2)", 0.1)]
    # main is in every busy sample: an entry point, left out; the waiting loop is not counted
    assert s["inclusive"] == [("step (e.py:5)", 0.9), ("mm (m.py:9)", 0.6), ("attn (m.py:20)", 0.3),
                              ("poll (l.py:2)", 0.1)]


def test_the_per_request_detail_splits_the_second_token_gap_from_the_other_itls():
    raw = vllm_result(ttft=100.0, tpot=20.0, out_tok_s=110.0)
    raw["itls"] = [[0.1, 0.02, 0.03], [0.09, 0.02, 0.02], []]  # seconds, as vllm bench serve keeps them
    row = record("pdserve", "rate2", raw)
    assert row["second_token_gap_ms"] == {"p50": 95.0, "p90": 99.0, "p99": 99.9}  # linear between ranks, as vLLM's
    assert row["steady_itl_ms"] == {"p50": 20.0, "p90": 27.0, "p99": 29.7}
    assert "first-to-second-token gap" in markdown(doc_with([row]))
    assert "second_token_gap_ms" not in record("pdserve", "rate2", vllm_result(100.0, 20.0, 110.0))

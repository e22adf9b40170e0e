"""The planner's answer moves the right way when the rate, the SLOs or the prompts change,
and what it prints is a config ``pdserve serve --config`` reads."""

import dataclasses
import functools

import pytest
import yaml

from pdserve.cluster.autoscaling import from_mapping
from pdserve.cli import main
from pdserve.cluster.settings import serve_settings
from pdserve.planner.hardware import GPU_PROFILES
from pdserve.planner.metrics import Slo
from pdserve.planner.model_spec import get_model
from pdserve.planner.report import autoscaling_config
from pdserve.planner.search import PlanError, PlanRequest, plan
from pdserve.planner.synthetic import LengthMix

BASE = PlanRequest(get_model("Llama-3.1-8B"), GPU_PROFILES["A100"], 20.0, LengthMix(755, 200, 0.5), Slo(0.5, 0.05),
                   tp_choices=(1,), num_requests=250, min_duration_s=8.0, modes=("disaggregated",))


@functools.lru_cache(maxsize=None)
def planned(**changes):
    lengths = changes.pop("prompt", None)
    slo = changes.pop("slo", None)
    req = dataclasses.replace(BASE, **changes)
    if lengths:
        req = dataclasses.replace(req, lengths=dataclasses.replace(req.lengths, prompt_mean=lengths))
    if slo:
        req = dataclasses.replace(req, slo=Slo(*slo))
    return plan(req)


def test_a_higher_rate_needs_more_gpus():
    assert planned(rate=80.0).gpus > planned().gpus


def test_longer_prompts_need_more_prefill_workers():
    assert planned(prompt=3000).layout.prefill > planned().layout.prefill


def test_a_tighter_ttft_slo_needs_more_prefill_workers():
    assert planned(slo=(0.15, 0.05)).layout.prefill > planned().layout.prefill


def test_a_tighter_tpot_slo_needs_more_decode_workers():
    assert planned(rate=80.0, slo=(0.5, 0.03)).layout.decode > planned(rate=80.0).layout.decode


def test_every_plan_meets_the_attainment_asked_for():
    for p in (planned(), planned(rate=80.0), planned(prompt=3000)):
        assert p.attainment >= BASE.attainment


def test_the_printed_config_is_one_pdserve_serve_reads():
    config = autoscaling_config(planned(), BASE)
    text = yaml.safe_load(yaml.safe_dump(config))
    known = {s.name for s in serve_settings()} | {"autoscaling"}
    assert set(text) <= known
    pools = from_mapping(text["autoscaling"])
    assert pools["prefill"].slo_s == 0.5 and pools["decode"].slo_s == 0.05
    assert pools["prefill"].max_replicas >= text["prefill"]


def test_an_impossible_slo_says_which_setting():
    with pytest.raises(PlanError, match="rate: no layout"):
        plan(dataclasses.replace(BASE, slo=Slo(0.001, 0.05), num_requests=50, max_workers=8))


def test_cli_simulates_a_given_layout(capsys):
    assert main(["plan", "--model", "Llama-3.1-8B", "--hardware", "A100", "--rate", "5", "--requests", "100",
                 "--layout", "1P:1D", "--ttft-slo", "0.5", "--tpot-slo", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "layout: 1P (TP1) : 1D (TP1) = 2 GPUs" in out and "autoscaling:" in out


def test_cli_rejects_a_bad_layout(capsys):
    assert main(["plan", "--layout", "2X"]) == 2
    assert "--layout: expected like 2P:3D" in capsys.readouterr().err


def test_cli_replays_a_trace_the_router_wrote(tmp_path, capsys):
    from pdserve.router.request_trace import TraceWriter

    path = tmp_path / "router.jsonl"
    clock = iter(float(i) * 0.5 for i in range(40))
    with TraceWriter(path, clock=lambda: next(clock)) as w:
        for i in range(40):
            w.record(list(range(600 + i)), 50)
    assert main(["plan", "--model", "Llama-3.1-8B", "--hardware", "A100", "--trace", str(path),
                 "--layout", "1P:1D", "--ttft-slo", "0.5", "--tpot-slo", "0.05"]) == 0
    out = capsys.readouterr().out
    assert f"on A100; {40 / 19.5:g} req/s" in out  # the trace's own rate: 40 requests over 19.5 s
    assert "SLO attainment 100.0%" in out

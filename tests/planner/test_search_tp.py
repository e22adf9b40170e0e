"""The plan search's tensor-parallel candidates: the degrees the engine refuses are skipped with
the reason, pools of different TP are searched in pairs, and ``pdserve plan`` answers for a
dense 70B model and for DeepSeek-V3 (MoE + MLA) on H100s."""

import dataclasses

import pytest

from pdserve.cli import main
from pdserve.planner.hardware import GPU_PROFILES
from pdserve.planner.metrics import Slo
from pdserve.planner.model_spec import get_model
from pdserve.planner.search import PlanRequest, _candidates, plan
from pdserve.planner.synthetic import LengthMix

LLAMA_H100 = PlanRequest(get_model("Llama-3.3-70B"), GPU_PROFILES["H100"], 4.0, LengthMix(755, 200, 0.5),
                         Slo(1.0, 0.1), num_requests=120, min_duration_s=10.0)


def _searched(req: PlanRequest) -> tuple[list[tuple[str, int, int]], list[str]]:
    said: list[str] = []
    return _candidates(req, said.append), said


def test_degrees_the_engine_refuses_or_that_do_not_fit_are_skipped_with_the_reason():
    found, said = _searched(dataclasses.replace(LLAMA_H100, tp_choices=(1, 3, 4, 8, 16)))
    assert found == [(mode, tp, tp) for tp in (4, 8) for mode in ("disaggregated", "colocated")]
    assert said[0].startswith("skipped TP1: Llama-3.3-70B weights (139 GB) do not fit 1 x H100")
    assert said[1:] == ["skipped TP3: num_attention_heads (64) is not divisible by tensor_parallel_size (3)",
                        "skipped TP16: num_key_value_heads (8) is not divisible by tensor_parallel_size (16)"]


def test_per_pool_choices_search_every_pair_where_one_divides_the_other():
    req = dataclasses.replace(LLAMA_H100, tp_choices=(4,), prefill_tp_choices=(4, 8), decode_tp_choices=(4, 8))
    found, said = _searched(req)
    assert found == [("disaggregated", 4, 4), ("disaggregated", 4, 8), ("disaggregated", 8, 4),
                     ("disaggregated", 8, 8), ("colocated", 4, 4)] and said == []
    _, said = _searched(dataclasses.replace(req, prefill_tp_choices=(6,), decode_tp_choices=(4,)))
    assert said == ["skipped TP6: num_attention_heads (64) is not divisible by tensor_parallel_size (6)"]
    six_heads = dataclasses.replace(get_model("OPT-13B"), num_heads=24, num_kv_heads=24, intermediate_size=4800)
    _, said = _searched(dataclasses.replace(req, model=six_heads, prefill_tp_choices=(6,), decode_tp_choices=(4,)))
    assert said == ["skipped prefill TP6 / decode TP4: prefill TP 6 and decode TP 4: the KV moves by head only "
                    "between sizes where one divides the other"]


def test_a_split_search_returns_the_pools_at_their_own_degrees():
    req = dataclasses.replace(LLAMA_H100, tp_choices=(4,), prefill_tp_choices=(8,), decode_tp_choices=(4,),
                              modes=("disaggregated",))
    lay = plan(req).layout
    assert (lay.tp_prefill, lay.tp_decode) == (8, 4) and lay.gpus == 8 * lay.prefill + 4 * lay.decode


def test_cli_simulates_pools_of_different_tp(capsys):
    assert main(["plan", "--model", "Llama-3.3-70B", "--hardware", "H100", "--rate", "2", "--requests", "60",
                 "--layout", "1P:2D", "--prefill-tp", "8", "--decode-tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "layout: 1P (TP8) : 2D (TP4) = 16 GPUs" in out
    assert "# pdserve serve --config plan.yaml --prefill-tp 8 --decode-tp 4" in out
    assert "gpus_per_worker" not in out  # one count would be wrong for one of the pools


@pytest.mark.parametrize("args, error", [
    (["--model", "DeepSeek-V3", "--layout", "1P:1D:TP8"], "--layout: TP8: DeepSeek-V3 weights (1340 GB) do not fit 8"),
    (["--model", "Llama-3.3-70B", "--layout", "1P:1D:TP16"], "--layout: TP16: num_key_value_heads (8)"),
    (["--layout", "2C", "--decode-tp", "2"], "--decode-tp: with --layout, one degree for a disaggregated layout"),
    (["--tp", "0,2"], "--tp: degrees must be >= 1"),
])
def test_cli_refuses_a_tp_the_engine_cannot_run(capsys, args, error):
    assert main(["plan", "--hardware", "H100", "--requests", "20", *args]) == 2
    assert error in capsys.readouterr().err


def test_cli_plans_deepseek_v3_on_h100s(capsys):
    """bf16 DeepSeek-V3 (1.34 TB of weights) needs 32 H100s a worker: TP8 and TP16 are skipped."""
    assert main(["plan", "--model", "DeepSeek-V3", "--hardware", "H100", "--rate", "1", "--requests", "30",
                 "--tp", "8,16,32", "--mode", "disaggregated", "--ttft-slo", "2", "--tpot-slo", "0.2"]) == 0
    captured = capsys.readouterr()
    assert "skipped TP8: DeepSeek-V3 weights" in captured.err and "skipped TP16" in captured.err
    assert "layout: 1P (TP32) : 1D (TP32) = 64 GPUs (disaggregated)" in captured.out

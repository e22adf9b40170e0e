"""``--layout auto``'s choice (pdserve/planner/auto_layout.py) on fixed profiles: which layout wins
where prefill or decode is the bottleneck, the margin that keeps the default, the goodput search,
and what the log says. Simulated only; no test times anything."""

import dataclasses

import pytest

from pdserve.planner.auto_layout import (DEFAULT_MARGIN, SERVED_OVER_SIMULATED, Candidate, Objective, candidates,
                                         choose, choose_for_settings, decide, kernel_path, predicted_goodput,
                                         profile_for)
from pdserve.planner.layout import Layout
from tests.helpers.planner_profiles import CORE, SMOL

# Prefill ten times faster, decode four times slower: decode is the bottleneck.
FAST_PREFILL = dataclasses.replace(CORE, name="fast prefill", peak_flops=1e12, peak_mem_bw=7.5e9,
                                   seq_overhead_s=0.0036)
QUICK = Objective(requests=150)


def names(cs):
    return [c.name for c in cs]


def test_candidates_are_every_split_colocated_and_elastic_with_the_even_split_first():
    assert names(candidates(2)) == ["1P:1D", "2C", "elastic from 1P:1D"]
    assert names(candidates(4)) == ["2P:2D", "1P:3D", "3P:1D", "4C", "elastic from 2P:2D"]
    assert names(candidates(1)) == names(candidates(2))  # two workers at least: one a role
    assert candidates(64)[0].layout == Layout(prefill=4, decode=4)  # at most 8 workers


def test_each_candidate_spells_its_serve_settings():
    two_c, elastic = candidates(2)[1:]
    assert two_c.settings() == {"mode": "colocated", "decode": 2, "elastic_roles": False, "role_budget": False}
    assert elastic.settings() == {"mode": "disaggregated", "prefill": 1, "decode": 1, "elastic_roles": True,
                                  "role_budget": True}
    assert (two_c.kind, elastic.kind, candidates(2)[0].kind) == ("colocated", "elastic", "disaggregated")


@pytest.mark.parametrize("threshold", [0.3, 1.3, 7.0])
def test_goodput_search_finds_the_highest_rate_that_meets(threshold):
    found = predicted_goodput(lambda rate: rate <= threshold)
    assert threshold * 0.97 <= found <= threshold


def test_goodput_search_gives_zero_where_nothing_meets_and_its_limit_where_everything_does():
    assert predicted_goodput(lambda rate: False) == 0.0
    assert predicted_goodput(lambda rate: True, limit=100) == 64.0  # the last rate tried under the limit


def test_a_candidate_replaces_the_default_only_beyond_the_margin():
    default, other, _ = candidates(2)
    factors = {"disaggregated": 1.0, "colocated": 1.0}
    close = decide([(default, 1.0), (other, 1.0 + DEFAULT_MARGIN * 0.9)], factors=factors)
    far = decide([(default, 1.0), (other, 1.0 + DEFAULT_MARGIN * 1.1)], factors=factors)
    assert close.chosen == default and "too close" in close.reason
    assert far.chosen == other and "more than 15% above" in far.reason


def test_predictions_are_corrected_by_each_kinds_served_over_simulated_factor():
    default, two_c, elastic = candidates(2)
    factors = {"disaggregated": 1.2, "colocated": 0.75, "elastic": 1.3}
    choice = decide([(default, 1.0), (two_c, 1.3), (elastic, 1.0)], factors=factors)
    goodput = {p.candidate.name: p.goodput for p in choice.predictions}
    assert goodput == pytest.approx({"1P:1D": 1.2, "2C": 1.3 * 0.75, "elastic from 1P:1D": 1.3})
    # simulated, colocated would win by 30%; corrected, it is below the default
    assert choice.chosen == default
    # the module's own factors are the ones used when none are given
    plain = decide([(default, 1.0), (two_c, 1.3), (elastic, 1.0)])
    assert [p.factor for p in plain.predictions] == [SERVED_OVER_SIMULATED[k] for k in
                                                     ("disaggregated", "colocated", "elastic")]


def test_prefill_slow_against_the_arrivals_is_carried_by_the_decode_workers_overflow():
    """One core's prefill (~0.7 s a prompt) limits one prefill worker to ~1 req/s, but as served
    the two decode workers of 1P:2D prefill what it falls behind on (prefill that keeps up), so
    the default split serves about what two prefill workers do, far above one prefill worker
    alone, and stays."""
    choice = choose(SMOL, CORE, 3, QUICK)
    goodput = {p.candidate.name: p.goodput for p in choice.predictions}
    assert choice.chosen.name == "1P:2D", choice.lines()
    assert goodput["1P:2D"] > 0.9 * goodput["2P:1D"]
    assert choice.predictions[0].simulated > 2.0  # one prefill worker alone: about 1 req/s


def test_prefill_fast_picks_the_layout_with_the_most_decoding_cores():
    """With prefill ten times faster and decode the bottleneck, two prefill workers help nothing,
    and three colocated workers decode on every core: they beat the default split, whose one
    prefill core idles, by more than the margin."""
    choice = choose(SMOL, FAST_PREFILL, 3, QUICK)
    goodput = {p.candidate.name: p.goodput for p in choice.predictions}
    assert choice.chosen.name == "3C", choice.lines()
    assert goodput["1P:2D"] > 2 * goodput["2P:1D"]


def test_the_log_names_every_candidate_its_goodput_and_the_choice():
    choice = choose(SMOL, CORE, 2, QUICK)
    lines = choice.lines()
    for c in candidates(2):
        assert any(line.startswith(c.name) and "predicted goodput" in line for line in lines)
    assert lines[-1].startswith(f"chose {choice.chosen.name}: ")


def test_serve_settings_get_nothing_when_the_default_stays(monkeypatch):
    """The adapter ``pdserve serve`` calls: the default winning changes no setting (``make
    serve``'s 1P:1D with the cores split stays), and its log says what ran on what."""
    from pdserve.planner import auto_layout

    monkeypatch.setattr(auto_layout.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(auto_layout, "choose", lambda model, hw, cores, objective: decide(
        [(c, 1.0) for c in candidates(cores)], factors={}))
    v = {"model": "default", "layout_ttft_slo_s": 2.0, "layout_tpot_slo_s": 0.1, "layout_prompt_tokens": 256,
         "layout_output_tokens": 64}
    chosen, lines = choose_for_settings(v)
    assert chosen == {}
    assert lines[0].startswith(f"2 core(s), kernel path {kernel_path()}, SmolLM2-135M, objectives TTFT <= 2 s and "
                               "TPOT <= 100 ms")
    assert lines[-1].startswith("chose 1P:1D")


def test_serve_settings_of_a_winner_and_an_unreadable_model(monkeypatch, tmp_path):
    from pdserve.planner import auto_layout

    monkeypatch.setattr(auto_layout, "choose", lambda model, hw, cores, objective: decide(
        [(c, 1.0 if i else 0.5) for i, c in enumerate(candidates(2))], factors={}))
    v = {"model": "default", "layout_ttft_slo_s": 2.0, "layout_tpot_slo_s": 0.1, "layout_prompt_tokens": 256,
         "layout_output_tokens": 64}
    assert choose_for_settings(v)[0] == Candidate("2C", Layout(colocated=2)).settings()
    chosen, lines = choose_for_settings({**v, "model": str(tmp_path / "missing")})
    assert chosen == {} and "the default layout stays" in lines[0]


def test_the_kernel_paths_own_profile_is_used_where_one_is_stored(tmp_path):
    (tmp_path / "cpu.json").write_text("{}")
    assert profile_for("avx2", tmp_path) == tmp_path / "cpu.json"
    (tmp_path / "cpu-avx2.json").write_text("{}")
    assert profile_for("avx2", tmp_path) == tmp_path / "cpu-avx2.json"
    assert profile_for("amx", tmp_path) == profile_for(None, tmp_path) == tmp_path / "cpu.json"


def test_the_kernel_path_comes_from_the_pin_else_the_processors_flags(monkeypatch):
    from pdserve.engine.kernels import cpu_kernels

    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    assert kernel_path() == "avx2"
    monkeypatch.delenv("PDSERVE_CPU_ISA")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: ["avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                          "avx512dq", "avx512_bf16"])
    assert kernel_path() == "avx512_bf16"
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: ["avx2"])  # no FMA: no path
    assert kernel_path() is None


def test_a_cpu_worker_is_sized_from_the_hosts_memory_so_a_1b_checkpoint_fits(tmp_path):
    """A stored CPU profile holds the memory of the machine it was measured on (1.3 GB: a 135M
    model and 1 GiB of KV), which refused a Llama-3.2-1B-shaped checkpoint at start on a 24 GiB
    host; sized from the host's RAM shared by its cores, the cost model takes it. A GPU
    profile keeps its device's memory."""
    import json

    from pdserve.planner.auto_layout import on_this_host
    from pdserve.planner.cost import CostError, CostModel
    from pdserve.planner.hardware import DEFAULT_CPU_PROFILE, GPU_PROFILES, HardwareProfile
    from pdserve.planner.model_spec import get_model

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, tie_word_embeddings=True)))
    llama_1b, cpu = get_model(str(tmp_path)), HardwareProfile.load(DEFAULT_CPU_PROFILE)
    with pytest.raises(CostError, match="do not fit"):
        CostModel(llama_1b, cpu).kv_capacity_tokens()
    need = llama_1b.weight_bytes(2) + 2**30  # its weights and the default 1 GiB of KV
    host = on_this_host(cpu, cores=2, need_bytes=need, host_bytes=24 * 2**30)
    assert host.mem_bytes == need  # the KV it models is the worker's setting, not the host's RAM
    assert CostModel(llama_1b, host).kv_capacity_tokens() == int(2**30 / CostModel(llama_1b, host).kv_bytes_per_token)
    small = on_this_host(cpu, cores=2, need_bytes=need, host_bytes=4 * 2**30)  # 2 GiB a worker: the weights alone
    with pytest.raises(CostError, match="do not fit"):
        CostModel(llama_1b, small).kv_capacity_tokens()
    assert on_this_host(GPU_PROFILES["H100"], cores=2, need_bytes=need, host_bytes=1 << 40) == GPU_PROFILES["H100"]


def test_a_model_the_planner_cannot_cost_keeps_the_default_layout_and_says_why(monkeypatch):
    from pdserve.planner import auto_layout
    from pdserve.planner.cost import CostError

    def refuse(model, hw, cores, objective):
        raise CostError("tp", "weights (900 GB) do not fit 1 x cpu; raise tp")

    monkeypatch.setattr(auto_layout, "choose", refuse)
    v = {"model": "default", "layout_ttft_slo_s": 2.0, "layout_tpot_slo_s": 0.1, "layout_prompt_tokens": 256,
         "layout_output_tokens": 64}
    chosen, lines = choose_for_settings(v)
    assert chosen == {} and lines == ["no prediction (tp: weights (900 GB) do not fit 1 x cpu; raise tp); "
                                      "the default layout stays"]

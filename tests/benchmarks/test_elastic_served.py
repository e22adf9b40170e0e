"""The served elastic-roles benchmark's plan (benchmarks/elastic_served.py): which layouts it
serves, with which flags, and the phases' workloads."""

import argparse

from benchmarks.elastic_served import MIXED, SERIES, layouts, phases
from benchmarks.load import parse_lengths


def args(**kw):
    base = dict(workers=3, rate_prompts=0.8, rate_answers=2.5, long_prompt=768, long_output=192, slo_ttft_ms=1500.0,
                slo_tpot_ms=70.0, dwell_s=10.0, window_s=8.0, elastic_prefill=None)
    return argparse.Namespace(**{**base, **kw})


def test_every_fixed_split_then_elastic_with_the_benchmarks_slo():
    plan = layouts(args())
    assert [name for name, _ in plan] == ["1P:2D", "2P:1D", "colocated 3", "colocated 1", "elastic from 2P:1D"]
    assert plan[2][1] == ["--mode", "colocated", "--decode", "3"] and plan[3][1] == ["--mode", "colocated", "--decode", "1"]
    flags = plan[-1][1]
    assert flags[:4] == ["--prefill", "2", "--decode", "1"] and "--elastic-roles" in flags and "--role-budget" in flags
    assert flags[flags.index("--role-budget-ttft-slo-s") + 1] == "1.5"
    assert flags[flags.index("--role-budget-itl-slo-s") + 1] == "0.07"
    assert [name for name, _ in layouts(args(workers=4))] == ["1P:3D", "2P:2D", "3P:1D", "colocated 4", "colocated 1",
                                                             "elastic from 2P:2D"]
    assert [name for name, _ in layouts(args(workers=2))] == ["1P:1D", "colocated 2", "colocated 1", "elastic from 1P:1D"]
    assert layouts(args(elastic_prefill=1))[-1][0] == "elastic from 1P:2D"


def test_phases_shift_from_long_prompts_to_long_answers_and_back():
    names = [p[0] for p in phases(args())]
    assert names == ["long prompts", "long answers", "long prompts again"]
    for _, rate, prompt, output in phases(args()):
        parse_lengths(prompt, "prompt"), parse_lengths(output, "output")  # valid length specs
    assert phases(args())[0][1:] == phases(args())[2][1:]


def test_the_scraper_reads_the_routers_pool_series():
    m = SERIES.match('pdserve:role_budget_pressure{pool="decode"} 1.25')
    assert m and m.groups() == ("role_budget_pressure", "decode", "1.25")
    assert SERIES.match('pdserve:pool_replicas{pool="prefill"} 2.0')
    assert MIXED.match("pdserve:mixed_workers 1.0").group(1) == "1.0"


def test_the_simulated_comparison_names_the_served_layouts():
    """--simulate: the same phases in the planner's simulator, by the served layouts' names (the
    figures themselves are the benchmark's)."""
    from benchmarks.elastic_served import simulate
    from benchmarks.load import SLO

    out = simulate(args(workers=2, phase_s=10.0, seed=0), SLO(1500.0, 70.0), "cpu")
    assert list(out) == ["1P:1D", "colocated 2", "elastic from 1P:1D"]
    assert all(g >= 0 for g in out.values())

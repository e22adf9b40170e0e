"""``pdserve plan`` and ``pdserve profile``: argument parsers and entry points
(``pdserve.cli`` registers them)."""

from __future__ import annotations

import re
import sys

from pdserve.planner.cost import CostError
from pdserve.planner.hardware import DEFAULT_CPU_PROFILE, ProfileError, get_profile
from pdserve.planner.metrics import Slo
from pdserve.planner.model_spec import ModelSpecError, get_model
from pdserve.planner.synthetic import PREFIX_ORDERS, LengthMix
from pdserve.planner.trace import TraceError, read_trace


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="size prefill and decode pools for a rate at an SLO (simulated)",
                       description="Search pool sizes and tensor parallelism for the fewest GPUs that serve "
                                   "--rate at --attainment of both SLOs, with pdserve's own scheduler rules, "
                                   "routing policy and a cost model of the hardware.")
    p.add_argument("--model", default="Llama-3.1-8B", help="a model by name (listed in docs/planning.md; "
                   "an unknown name lists them) or a HF model directory")
    p.add_argument("--hardware", default="H100", help="H100, H200, A100, L40S, cpu, or a profile .json")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: the trace's rate, else 10)")
    p.add_argument("--prompt-mean", type=int, default=755, help="mean prompt tokens (default: ShareGPT's 755)")
    p.add_argument("--output-mean", type=int, default=200, help="mean output tokens (default: ShareGPT's 200)")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal spread of lengths; 0 for fixed")
    p.add_argument("--max-len", type=int, default=4096, help="longest prompt or output drawn")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="seconds")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests meeting both SLOs")
    p.add_argument("--tp", default="1,2,4,8",
                   help="tensor-parallel degrees to try, comma-separated: colocated workers, and both pools alike "
                        "unless --prefill-tp / --decode-tp are given")
    p.add_argument("--prefill-tp", default=None,
                   help="the prefill pool's degrees (default: --tp); with either per-pool flag every prefill x "
                        "decode pair where one divides the other is searched. With --layout: one degree")
    p.add_argument("--decode-tp", default=None, help="the decode pool's degrees (default: --tp); see --prefill-tp")
    p.add_argument("--mode", choices=("both", "disaggregated", "colocated"), default="both")
    p.add_argument("--requests", type=int, default=3000,
                   help="requests simulated per candidate layout; arrivals always span at least 60 s, so at "
                        "high rates more are simulated (2000 req/s: about 120,000)")
    p.add_argument("--trace", default=None, help="replay this JSONL trace instead of Poisson arrivals")
    p.add_argument("--layout", default=None, help="simulate this layout only, e.g. 2P:3D, 2P:3D:TP4 or 4C:TP2")
    p.add_argument("--prefixes", type=int, default=0,
                   help="Poisson prompts start with one of this many shared prefixes of --prefix-tokens tokens "
                        "(--prompt-mean is then what follows the prefix); 0: none")
    p.add_argument("--prefix-tokens", type=int, default=0, help="tokens of each shared prefix (with --prefixes)")
    p.add_argument("--prefix-order", choices=PREFIX_ORDERS, default="random",
                   help="each prompt's prefix drawn at random, or in turn (cyclic: a working set revisited)")
    p.add_argument("--kv-offload-bytes", type=int, default=0,
                   help="bytes of KV tier below the prefix cache on each host, shared by its workers (as "
                        "pdserve serve's flag); evicted prefix blocks are loaded from it instead of computed. "
                        "0: none")
    p.add_argument("--elastic", action="store_true",
                   help="with --layout kP:mD: compare every fixed split of its k+m workers (and k+m colocated) "
                        "with elastic roles starting from it (--elastic-roles --role-budget), by goodput")


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure the engine on this machine and fit the 'cpu' hardware profile")
    p.add_argument("--model", default="default", help="model to measure (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (the cluster runs one per worker)")
    p.add_argument("--output", default=str(DEFAULT_CPU_PROFILE), help="profile file to write")
    p.add_argument("--quick", action="store_true", help="fewer points (about a minute)")
    p.add_argument("--only", choices=("fit", "gemms"), default=None,
                   help="fit: the profile alone; gemms: the prefill GEMM table alone (GFLOP/s per kernel path "
                        "against the core's peak and torch's matmul, under a minute). Default: both")


def run_plan(args) -> int:
    from pdserve.planner.report import format_plan
    from pdserve.planner.search import PlanError, PlanRequest, Plan, plan, simulate

    try:
        if args.trace and args.prefixes:
            raise ValueError("--prefixes: not with --trace (a trace's requests name their own prefixes)")
        replay = tuple(read_trace(args.trace)) if args.trace else None
        rate = args.rate or (_trace_rate(replay) if replay else 10.0)
        req = PlanRequest(get_model(args.model), get_profile(args.hardware), rate,
                          LengthMix(args.prompt_mean, args.output_mean, args.sigma, args.max_len),
                          Slo(args.ttft_slo, args.tpot_slo), args.attainment, _tp_list(args.tp, "--tp"),
                          prefill_tp_choices=_tp_list(args.prefill_tp, "--prefill-tp"),
                          decode_tp_choices=_tp_list(args.decode_tp, "--decode-tp"),
                          num_requests=args.requests, modes=_modes(args.mode), replay=replay,
                          num_prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
                          prefix_order=args.prefix_order, kv_offload_bytes=args.kv_offload_bytes)
        if args.elastic:
            if not args.layout:
                raise ValueError("--elastic: needs --layout, the split elastic roles start from (e.g. 1P:2D)")
            return _print_elastic(req, parse_layout(args.layout))
        if args.layout:
            layout = _pool_tps(parse_layout(args.layout), req)
            result = simulate(req, layout, req.trace())
            found = Plan(layout, result, result.attainment(req.slo))
        else:
            found = plan(req, progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    except (PlanError, ProfileError, ModelSpecError, TraceError, CostError, ValueError) as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(found, req))
    return 0


def _print_elastic(req, start) -> int:
    from pdserve.planner.elastic import compare_layouts

    rows = compare_layouts(req, req.trace(), start)
    print(f"{len(req.trace())} requests, SLO TTFT {req.slo.ttft_s} s / TPOT {req.slo.tpot_s} s")
    print(f"{'layout':<32} {'goodput req/s':>14} {'attainment':>11} {'TTFT p90 s':>11} {'TPOT p90 s':>11}")
    for name, result in rows:
        pct = result.percentiles()
        print(f"{name:<32} {result.goodput_rps(req.slo):>14.3f} {result.attainment(req.slo):>11.3f} "
              f"{pct['ttft_s']['p90']:>11.3f} {pct['tpot_s']['p90']:>11.3f}")
    return 0


def run_profile(args) -> int:
    if args.only != "gemms":
        _fit_profile(args)
    if args.only != "fit":
        _print_gemms(args.model)
    return 0


def _fit_profile(args) -> None:
    import json
    from pathlib import Path

    from pdserve.planner.profile import FULL, QUICK, profile_engine, save_points

    profile, points, spec = profile_engine(args.model, args.dtype, args.threads, QUICK if args.quick else FULL)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.output)
    points_path = Path(args.output).with_suffix(".points.json")
    save_points(points_path, points, profile, spec)
    print(f"pdserve profile: wrote {args.output} and {points_path}")
    print(f"  step overhead {profile.step_overhead_s * 1e3:.1f} ms, bandwidth {profile.mem_bw / 1e9:.1f} GB/s, "
          f"{profile.flops / 1e9:.1f} GFLOP/s, KV link {profile.kv_link_bw / 1e9:.1f} GB/s, "
          f"KV tier load {profile.kv_tier_bw / 1e9:.1f} GB/s")
    if profile.prefill_attention_flops and profile.decode_attention_flops:
        print(f"  attention: prefill {profile.prefill_attention_flops / 1e9:.1f} GFLOP/s, "
              f"decode {profile.decode_attention_flops / 1e9:.1f} GFLOP/s")
    for row in json.loads(points_path.read_text()):
        print(f"  {row['kind']:<8} batch {row['batch']:>3} tokens {row['tokens']:>5}: measured "
              f"{row['measured_s'] * 1e3:8.1f} ms, fitted {row['fitted_s'] * 1e3:8.1f} ms")


def _print_gemms(model: str) -> None:
    """The prefill GEMM table (planner/gemm_bench.py) for ``model``'s projections, one thread."""
    import os

    from pdserve.engine.kernels import cpu_kernels
    from pdserve.planner import gemm_bench
    from pdserve.planner.peak import this_core

    spec = get_model("SmolLM2-135M" if model == "default" else model)
    core, paths = this_core(), cpu_kernels.runnable_isas()
    load = os.getloadavg()[0]
    cells = gemm_bench.measure(gemm_bench.prefill_gemms(spec), paths)
    print(f"prefill GEMMs of {spec.name} on {cpu_kernels.cpu_model()}, one thread, fastest of 5 runs on its CPU "
          f"time; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
    print("\n".join(gemm_bench.table(cells, core)))
    print("\n".join(gemm_bench.notes(core, paths)))


def parse_layout(text: str):
    """``2P:3D`` (TP1), ``2P:3D:TP4``, ``4C`` or ``4C:TP2`` (colocated) as a ``Layout``."""
    from pdserve.planner.layout import Layout

    m = re.fullmatch(r"(?:(\d+)P:(\d+)D|(\d+)C)(?::TP(\d+))?", text.strip(), re.IGNORECASE)
    if not m:
        raise ValueError(f"--layout: expected like 2P:3D, 2P:3D:TP4 or 4C:TP2, got {text!r}")
    tp = int(m.group(4) or 1)
    if m.group(3):
        return Layout(colocated=int(m.group(3)), tp_decode=tp)
    return Layout(int(m.group(1)), int(m.group(2)), 0, tp, tp)


def _pool_tps(layout, req):
    """``--layout``'s TP, with one degree from --prefill-tp / --decode-tp overriding a pool's,
    checked as the search checks its candidates."""
    import dataclasses

    from pdserve.planner.search import tp_unusable
    from pdserve.planner.tp import pair_refusal

    for flag, choices, field in (("--prefill-tp", req.prefill_tp_choices, "tp_prefill"),
                                 ("--decode-tp", req.decode_tp_choices, "tp_decode")):
        if choices is not None:
            if len(choices) != 1 or layout.colocated:
                raise ValueError(f"{flag}: with --layout, one degree for a disaggregated layout, got {choices}")
            layout = dataclasses.replace(layout, **{field: choices[0]})
    for tp in {layout.tp_decode} if layout.colocated else {layout.tp_prefill, layout.tp_decode}:
        why = tp_unusable(req, tp)
        if why:
            raise ValueError(f"--layout: TP{tp}: {why}")
    why = None if layout.colocated else pair_refusal(layout.tp_prefill, layout.tp_decode)
    if why:
        raise ValueError(f"--layout: {why}")
    return layout


def _tp_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from exc
    if any(v < 1 for v in values):
        raise ValueError(f"{flag}: degrees must be >= 1, got {text!r}")
    return values


def _modes(mode: str) -> tuple[str, ...]:
    return ("disaggregated", "colocated") if mode == "both" else (mode,)


def _trace_rate(replay) -> float:
    span = replay[-1].t - replay[0].t if len(replay) > 1 else 1.0
    return len(replay) / max(span, 1e-9)

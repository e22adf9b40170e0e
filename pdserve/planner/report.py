"""How ``pdserve plan`` prints its answer: the layout, the expected percentiles, goodput per
GPU, and the per-pool autoscaling settings that follow from it, as ``pdserve serve --config`` YAML."""

from __future__ import annotations

import math

import numpy as np
import yaml

from pdserve.planner.cost import CostModel
from pdserve.planner.search import Plan, PlanRequest

# Decode scales on KV in use; 0.7 leaves room for running streams to grow before a full cache
# preempts them (the built-in default, see pdserve/cluster/autoscaling/config.py).
DECODE_KV_TARGET = 0.7


def autoscaling_config(plan: Plan, req: PlanRequest) -> dict:
    """The ``pdserve serve --config`` mapping: pool sizes and per-pool autoscaling targets.

    Prefill's target is the queue a worker clears in half the TTFT SLO at the mean prompt
    length (so queueing leaves half the SLO for the prefill itself); its latency SLO is the
    TTFT SLO. Decode's latency SLO is the TPOT SLO (ITL p90). Bounds: down to 1, up to twice
    the planned size for bursts.
    """
    lay = plan.layout
    if lay.colocated:  # one pool of workers running both phases: no per-pool autoscaling
        return {"mode": "colocated", "workers": lay.colocated, "gpus_per_worker": lay.tp_decode}
    cost = CostModel(req.model, req.hw, lay.tp_prefill)
    prompt = req.lengths.prompt_mean
    tokens_per_s = prompt / cost.prefill_s([(prompt, 0)])
    queue_target = max(float(req.limits.max_num_batched_tokens), round(tokens_per_s * req.slo.ttft_s / 2, -2))
    config = {
        "prefill": lay.prefill,
        "decode": lay.decode,
        "gpus_per_worker": lay.tp_decode,
        "autoscaling": {
            "prefill": {"min_replicas": 1, "max_replicas": max(2, 2 * lay.prefill), "target": queue_target,
                        "slo_s": req.slo.ttft_s},
            "decode": {"min_replicas": 1, "max_replicas": max(2, 2 * lay.decode), "target": DECODE_KV_TARGET,
                       "slo_s": req.slo.tpot_s},
        },
    }
    if lay.tp_prefill != lay.tp_decode:  # one GPU count per worker would be wrong for a pool: the flags say it
        del config["gpus_per_worker"]
    return config


def format_plan(plan: Plan, req: PlanRequest) -> str:
    r = plan.result
    pct = r.percentiles()
    lines = [
        f"model {req.model.name} on {req.hw.name}; {req.rate:g} req/s, prompts ~{req.lengths.prompt_mean} / "
        f"outputs ~{req.lengths.output_mean} tokens (sigma {req.lengths.sigma}); SLO TTFT {req.slo.ttft_s:g} s, "
        f"TPOT {req.slo.tpot_s:g} s at {req.attainment:.0%}",
        f"layout: {plan.layout.describe()} = {plan.gpus} GPUs ({plan.layout.mode})",
        f"SLO attainment {plan.attainment:.1%}; goodput {r.goodput_rps(req.slo):.2f} req/s = "
        f"{r.goodput_rps(req.slo) / max(plan.gpus, 1):.3f} req/s per GPU",
        f"simulated {len(r.arrival)} requests over {r.duration_s:.0f} s of arrivals",
        "expected (simulated)   p50        p90        p99",
    ]
    for name in ("ttft_s", "tpot_s", "itl_s"):
        p = pct[name]
        lines.append(f"  {name[:-2].upper():<20} " + " ".join(f"{_ms(p[k]):>10}" for k in ("p50", "p90", "p99")))
    if r.preemptions:
        lines.append(f"preemptions: {r.preemptions}")
    lines += cache_lines(r)
    lines.append("")
    lay = plan.layout
    tp_flags = f" --prefill-tp {lay.tp_prefill} --decode-tp {lay.tp_decode}" if lay.tp_prefill != lay.tp_decode else ""
    lines.append(f"# pdserve serve --config plan.yaml{tp_flags}")
    lines.append(yaml.safe_dump(autoscaling_config(plan, req), sort_keys=False, default_flow_style=None).rstrip())
    return "\n".join(lines)


def cache_lines(r) -> list[str]:
    """The prompt tokens the prefix cache and the KV tier gave (none: no line), overall and on
    revisits (requests whose prefix came before), with the revisits' TTFT p50."""
    c = r.cache
    if c is None or not (c.tier_bytes or c.revisit.any() or c.device_hit.any()):
        return []
    device, tier = c.shares()
    tier_text = (f"{tier:.1%} from the KV tier ({c.tier_bytes / 1e9:g} GB a host, {c.hosts} host(s), "
                 f"{c.blocks_offloaded} blocks in, {c.blocks_loaded} out)") if c.tier_bytes else "no KV tier"
    lines = [f"cached prompt tokens: {device:.1%} from workers' prefix caches, {tier_text}"]
    if c.revisit.any():
        device, tier = c.shares(c.revisit)
        done = c.revisit & np.isfinite(r.finish)
        p50 = float(np.median(r.ttft[done])) if done.any() else math.nan
        lines.append(f"  on revisits ({int(c.revisit.sum())} requests, a prefix seen before): {device + tier:.1%} "
                     f"cached ({device:.1%} prefix cache + {tier:.1%} KV tier), TTFT p50 {_ms(p50)}")
    return lines


def _ms(seconds: float) -> str:
    return "n/a" if not math.isfinite(seconds) else f"{seconds * 1000:.1f} ms"

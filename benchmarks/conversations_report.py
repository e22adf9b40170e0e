"""The conversations benchmark's numbers (benchmarks/conversations.py): per turn index and
pooled over turns 2 onward, ratios against vLLM, the tables it prints and its plot. Pure
functions over the recorded turns, apart from the plot's file."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from benchmarks.load.metrics import percentile

FOLLOW_UPS = "2+"  # the pooled group: every turn after the first
RATIO_KEYS = ("ttft_ms_p50", "ttft_ms_p99", "computed_tokens_mean", "itl_ms_p50", "itl_ms_p99")


def _num(x: float | None) -> float | None:
    """JSON has no NaN: an empty statistic is None."""
    return None if x is None or math.isnan(x) else round(x, 3)


def _mean(xs: list[float]) -> float | None:
    return _num(sum(xs) / len(xs)) if xs else None


def _group(turns: list, added: dict) -> dict:
    ok = [t for t in turns if t.error is None and t.chunks]
    ttft = [1000 * (t.chunks[0] - t.sent) for t in ok]
    itl = [1000 * (b - a) for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    cached = [t for t in ok if t.cached_tokens is not None and t.prompt_tokens is not None]
    alone = [t.kv_bytes for t in ok if t.kv_bytes is not None]
    return {"turns": len(turns), "failed": len(turns) - len(ok),
            "ttft_ms_p50": _num(percentile(ttft, 50)), "ttft_ms_p99": _num(percentile(ttft, 99)),
            "itl_ms_p50": _num(percentile(itl, 50)), "itl_ms_p99": _num(percentile(itl, 99)),
            "prompt_tokens_mean": _mean([t.prompt_tokens for t in ok if t.prompt_tokens is not None]),
            "cached_tokens_mean": _mean([t.cached_tokens for t in cached]),
            "computed_tokens_mean": _mean([t.prompt_tokens - t.cached_tokens for t in cached]),
            "message_words_mean": _mean([t.words for t in turns]),
            "new_prompt_tokens_mean": _mean([added[id(t)] for t in ok if id(t) in added]),
            "kv_bytes_alone_mean": _mean(alone), "kv_bytes_alone_turns": len(alone)}


def _added(turns: list) -> dict[int, int]:
    """Per follow-up turn: prompt tokens it added to the previous turn's prompt and answer
    (the new message, the template around it, and any re-tokenization of the answer)."""
    previous = {(t.conversation, t.turn): t for t in turns}
    out = {}
    for t in turns:
        p = previous.get((t.conversation, t.turn - 1))
        if p and None not in (t.prompt_tokens, p.prompt_tokens, p.completion_tokens):
            out[id(t)] = t.prompt_tokens - p.prompt_tokens - p.completion_tokens
    return out


def summarize(turns: list, kv_bytes_total: float | None) -> dict:
    """``by_turn``: {"1", "2", ..., "2+"} -> the group's statistics; the KV totals."""
    added, by_index = _added(turns), defaultdict(list)
    for t in turns:
        by_index[t.turn].append(t)
    groups = {str(k): _group(by_index[k], added) for k in sorted(by_index)}
    groups[FOLLOW_UPS] = _group([t for t in turns if t.turn >= 2], added)
    return {"by_turn": groups, "kv_bytes_per_turn_mean": _num(kv_bytes_total / len(turns))
            if kv_bytes_total is not None and turns else None}


def ratios(doc: dict) -> dict:
    """Each pdserve arm over vLLM, per group and key; None where either side lacks the figure."""
    if "vllm" not in doc["arms"]:
        return {}
    peer = doc["arms"]["vllm"]["by_turn"]
    out = {}
    for arm, result in doc["arms"].items():
        if arm == "vllm":
            continue
        out[arm] = {g: {k: _num(v[k] / peer[g][k]) if v.get(k) and g in peer and peer[g].get(k) else None
                        for k in RATIO_KEYS} for g, v in result["by_turn"].items()}
    return out


def _cell(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def print_tables(doc: dict) -> None:
    """Per server its table by turn; then each pdserve arm over vLLM (``doc["ratios_over_vllm"]``)."""
    cols = ("turns", "failed", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "prompt_tokens_mean",
            "cached_tokens_mean", "computed_tokens_mean", "message_words_mean", "new_prompt_tokens_mean",
            "kv_bytes_alone_mean", "kv_bytes_alone_turns")
    for arm, result in doc["arms"].items():
        print(f"\n{arm}: wall {result['wall_s']:.1f} s, KV bytes moved {_cell(result['kv_bytes_total'])} "
              f"({_cell(result['kv_bytes_per_turn_mean'])} per turn)")
        print("| turn | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for g, v in result["by_turn"].items():
            print(f"| {g} | " + " | ".join(_cell(v[c]) for c in cols) + " |")
    for arm, groups in doc["ratios_over_vllm"].items():
        print(f"\n{arm} / vllm:")
        print("| turn | " + " | ".join(RATIO_KEYS) + " |")
        print("|---" * (len(RATIO_KEYS) + 1) + "|")
        for g, v in groups.items():
            print(f"| {g} | " + " | ".join(_cell(v[k], 2) for k in RATIO_KEYS) + " |")


def plot(doc: dict, path: Path) -> None:
    """TTFT p50 (p99 dashed) and prompt tokens computed, by turn index, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm, result in doc["arms"].items():
        groups = {int(g): v for g, v in result["by_turn"].items() if g != FOLLOW_UPS}
        xs = sorted(groups)
        line, = ax1.plot(xs, [groups[x]["ttft_ms_p50"] for x in xs], marker="o", label=f"{arm} p50")
        ax1.plot(xs, [groups[x]["ttft_ms_p99"] for x in xs], ls="--", color=line.get_color(), label=f"{arm} p99")
        ax2.plot(xs, [groups[x]["computed_tokens_mean"] for x in xs], marker="o", label=arm)
    ax1.set(xlabel="turn", ylabel="TTFT (ms)", yscale="log", title="time to first token")
    for ax in (ax1, ax2):
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax2.set(xlabel="turn", ylabel="prompt tokens computed (mean)", title="prompt tokens computed per turn")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    w = doc["workload"]
    peer = f", vLLM {doc['vllm_dtype']}" if "vllm" in doc["arms"] else ""
    fig.suptitle(f"{w['conversations']} conversations x {w['turns']} turns, {doc['machine']['cpu_model']}, "
                 f"pdserve kernel path {doc['machine']['kernel_path']}{peer}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

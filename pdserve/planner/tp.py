"""Which tensor-parallel sizes the engine runs a model at, by the engine's own rule.

The engine splits every layer with ``TensorParallel.share`` (pdserve/engine/parallel.py),
which refuses a dimension the size does not divide. The planner asks the same function about
the same dimensions, so it never plans a TP the engine would refuse:
- attention heads, always (q|k|v are split by head, o_proj by the heads' columns);
- GQA's KV heads: the engine splits them evenly and does not replicate them, so the size must
  divide ``num_key_value_heads`` (vLLM instead replicates KV heads when TP exceeds them; the
  engine does not). MLA's latent has no head axis: every rank holds all of it;
- the dense MLP's width where a layer has one, and each routed expert's width and the shared
  experts' (the engine splits every expert in width, Megatron's split, not whole experts).

Across pools, a decode rank reads the heads it owns from the prefill ranks that hold them,
which the KV transfer does for sizes where one divides the other.
"""

from __future__ import annotations

from pdserve.engine.parallel import ShardError, TensorParallel
from pdserve.planner.model_spec import ModelSpec


def split_dims(model: ModelSpec) -> list[tuple[int, str]]:
    """(size, config field) of every dimension the engine splits over the ranks."""
    dims = [(model.num_heads, "num_attention_heads")]
    if not model.mla:
        dims.append((model.num_kv_heads, "num_key_value_heads"))
    if model.num_layers > model.moe_layers:
        dims.append((model.intermediate_size, "intermediate_size"))
    if model.moe:
        dims.append((model.moe_intermediate_size, "moe_intermediate_size"))
        if model.shared_intermediate_size:
            dims.append((model.shared_intermediate_size, "shared_intermediate_size"))
    return dims


def tp_refusal(model: ModelSpec, tp: int) -> str | None:
    """Why the engine cannot run ``model`` at ``tp`` ranks, or None where it can."""
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    ranks = TensorParallel(size=tp)
    try:
        for n, what in split_dims(model):
            ranks.share(n, what)
    except ShardError as exc:
        return str(exc)
    return None


def pair_refusal(prefill_tp: int, decode_tp: int) -> str | None:
    """Why a prefill pool at ``prefill_tp`` cannot hand its KV to a decode pool at ``decode_tp``."""
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        return (f"prefill TP {prefill_tp} and decode TP {decode_tp}: the KV moves by head only between sizes "
                "where one divides the other")
    return None

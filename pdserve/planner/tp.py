"""Which tensor-parallel sizes the engine runs a model at: the engine's layers say.

The engine splits every layer with ``TensorParallel.share`` (pdserve/engine/parallel.py),
which refuses a dimension the size does not divide, naming it. Rather than list those
dimensions again, the planner builds the model's layers at that size on the meta device
(``registry.check_split``: one layer of each kind, no memory) and reports what they refuse. For
the families today that is the attention heads; GQA's KV heads (the engine splits them evenly
and does not replicate them, as vLLM does when TP exceeds them; MLA's latent has no head axis);
the dense MLP's width; each routed expert's width and the shared experts'. A shape written by
hand is asked about as the engine's shared decoder of that shape.

Across pools, a decode rank reads the heads it owns from the prefill ranks that hold them,
which the KV transfer does for sizes where one divides the other.
"""

from __future__ import annotations

from pdserve.planner.model_spec import ModelSpec

# (the engine config's repr, size) -> the refusal: the search and every cost model ask again
# and again, and a probe of a model with experts takes tens of milliseconds.
_REFUSALS: dict[tuple[str, int], str | None] = {}


def tp_refusal(model: ModelSpec, tp: int) -> str | None:
    """Why the engine cannot run ``model`` at ``tp`` ranks, or None where it can."""
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if tp == 1:
        return None  # one rank holds every dimension whole
    cfg = model.engine_config
    key = (repr(cfg), tp)
    if key not in _REFUSALS:
        _REFUSALS[key] = _ask_the_layers(model, tp)
    return _REFUSALS[key]


def _ask_the_layers(model: ModelSpec, tp: int) -> str | None:
    import torch

    from pdserve.engine.models.decoder import CausalLM
    from pdserve.engine.models.registry import check_split
    from pdserve.engine.parallel import ShardError, TensorParallel

    try:
        if model.config is not None:
            check_split(model.config, tp)
        else:  # the shared decoder of a hand-written shape: its layers are all alike
            with torch.device("meta"):
                CausalLM(model.engine_config, TensorParallel(0, tp), layer_indices=(0,))
    except ShardError as exc:
        return str(exc)
    return None


def pair_refusal(prefill_tp: int, decode_tp: int) -> str | None:
    """Why a prefill pool at ``prefill_tp`` cannot hand its KV to a decode pool at ``decode_tp``."""
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        return (f"prefill TP {prefill_tp} and decode TP {decode_tp}: the KV moves by head only between sizes "
                "where one divides the other")
    return None

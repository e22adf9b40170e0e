"""Step and transfer times: pure functions of a model, a hardware profile and tensor parallelism.

- Prefill step: the new tokens' matmul FLOPs plus attention's quadratic term (each new token
  attends to the cached context and to the new tokens before it), over achievable FLOP/s
  (attention at its own rate where the profile measured one: the CPU's).
- Decode step: weight bytes plus the KV bytes of every running sequence, over achievable
  bandwidth; with a compute bound (batch x FLOPs per token) that wins at large batches. On
  a GPU the two overlap (the longer counts); on one CPU core they add.
- KV transfer: the prompt's KV bytes over the link, plus a fixed cost per transfer.
- KV tier load: a prefix's KV bytes at the tier's measured rate (``HardwareProfile.kv_tier_bw``).

A mixture-of-experts model's FLOPs per token are its active parameters' (the routed experts a
token picks, not all of them), and the weights a step streams are the dense part plus the
experts its tokens are expected to touch (``ModelSpec.streamed_weight_bytes``); the device
holds all of them. KV bytes per token are the engine's cache layout's
(``ModelSpec.kv_bytes_per_token``): an MLA model's is its latent.

Tensor parallelism of ``tp`` splits weights, KV heads and FLOPs over ``tp`` devices and adds
two all-reduces of the activations per layer over the interconnect. Only sizes the engine runs
(``pdserve.planner.tp``: the engine's layers, built at that size, refuse the others). Each rank
holds the cache the engine gives it at that size: its share of the KV heads, or all of MLA's
latent, which has no head axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.model_spec import ModelSpec
from pdserve.planner.tp import tp_refusal

ALLREDUCE_LATENCY_S = 8e-6  # one NCCL all-reduce of a small message within a node (NCCL tests: 5-10 us)
# Across nodes (a TP group wider than one node): an assumption, about three times the in-node
# latency for the network hops of a ring over InfiniBand; not measured here.
ALLREDUCE_LATENCY_INTERNODE_S = 25e-6
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of device memory for weights + KV


class CostError(ValueError):
    """A cost-model input is out of range; ``field`` names it."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec
    hw: HardwareProfile
    tp: int = 1
    mem_util: float = GPU_MEMORY_UTILIZATION  # share of device memory for weights + KV (vLLM's --gpu-memory-utilization)

    def __post_init__(self) -> None:
        if not 0 < self.mem_util <= 1:
            raise CostError("mem_util", f"must be within (0, 1], got {self.mem_util}")
        refusal = tp_refusal(self.model, self.tp)
        if refusal:
            raise CostError("tp", refusal)
        # Constants of the step-time formulas, computed once: the simulator calls them millions of
        # times. Each is the same expression the formulas spelled out inline, so results are bit-identical.
        m, hw = self.model, self.hw
        weights = m.weight_bytes(hw.dtype_bytes)
        # Attention at its own rate where the profile has one (the CPU fit): the seconds per
        # attention FLOP, else None and attention counts as matmul work.
        object.__setattr__(self, "_attn_p_s", m.attention_flops_per_pair / (hw.prefill_attention_flops * self.tp)
                           if hw.prefill_attention_flops else None)
        object.__setattr__(self, "_attn_d_s", m.attention_flops_per_pair / (hw.decode_attention_flops * self.tp)
                           if hw.decode_attention_flops else None)
        # KV bytes per token: the model's (one copy of every head, what a transfer moves), and
        # what a worker holds (and a decode step reads) over its ranks: MLA's latent once per rank.
        kvb = m.kv_bytes_per_token(hw.dtype_bytes)
        held = self.tp * m.kv_bytes_per_token(hw.dtype_bytes, self.tp)
        for name, value in (("_weights", weights), ("_kv_model", kvb), ("_kvb", held), ("_streamed", {}),
                            ("_bw", hw.mem_bw * self.tp), ("_flops", hw.flops * self.tp),
                            ("_lin", m.linear_flops_per_token), ("_head", m.lm_head_flops),
                            ("_lin_head", m.linear_flops_per_token + m.lm_head_flops),
                            ("_attn", m.attention_flops_per_pair)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_ratios", self._measured_ratios())

    # ---- capacity ------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> float:
        """The model's KV bytes per token: a key and a value per KV head over all layers (split
        over the ranks by head), or MLA's latent (every rank holds it whole)."""
        return self._kv_model

    @property
    def worker_kv_bytes_per_token(self) -> float:
        """KV bytes one token takes in a worker over all its ranks: the model's (split by head),
        or ``tp`` copies of MLA's latent (every rank holds it whole)."""
        return self._kvb

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV one worker (``tp`` devices) holds beside its weights (all of them, every
        expert of an MoE model)."""
        usable = self.hw.mem_bytes * self.tp * self.mem_util if self.hw.overlap else self.hw.mem_bytes
        free = usable - self._weights
        if free <= 0:
            raise CostError("tp", f"{self.model.name} weights ({self._weights / 1e9:.0f} GB) "
                                  f"do not fit {self.tp} x {self.hw.name}; raise tp")
        return int(free / self._kvb)

    def streamed_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step over ``tokens`` tokens reads: all of a dense model's; an MoE
        model's dense part and the experts those tokens are expected to touch (kept per count:
        the simulator asks for the same batch sizes again and again)."""
        if not self.model.moe:
            return self._weights
        nbytes = self._streamed.get(tokens)
        if nbytes is None:
            nbytes = self._streamed[tokens] = self.model.streamed_weight_bytes(tokens, self.hw.dtype_bytes)
        return nbytes

    # ---- step times ----------------------------------------------------------------
    def prefill_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int = 1) -> float:
        """One prefill step over ``chunks`` of (new tokens, tokens already cached before them)."""
        tokens = sum(n for n, _ in chunks)
        pairs = sum(n * c + n * (n + 1) / 2 for n, c in chunks)  # causal: token i sees c + i keys
        weights = self.streamed_weight_bytes(tokens) / self._bw  # a short chunk still streams them
        if self._attn_p_s is None:
            compute = (tokens * self._lin + pairs * self._attn + num_sampled * self._head) / self._flops
        else:
            compute = (tokens * self._lin + num_sampled * self._head) / self._flops + pairs * self._attn_p_s
        hw = self.hw
        body = max(compute, weights) if hw.overlap else compute + weights
        step = hw.step_overhead_s + len(chunks) * hw.seq_overhead_s + body + self._allreduce_s(tokens)
        return step * hw.served_prefill_factor  # 1 (exactly the step) unless a served probe measured one

    def decode_s(self, batch: int, total_context: float) -> float:
        """One decode step of ``batch`` sequences holding ``total_context`` tokens of KV between them."""
        if batch <= 0:
            return 0.0
        step = self.formula_decode_s(batch, total_context)
        if self._ratios:
            step *= self._ratio(batch, total_context / batch)
        hw = self.hw
        return step * hw.served_decode_factor + hw.served_step_s + batch * hw.served_seq_s  # x1.0 is exact

    def formula_decode_s(self, batch: int, total_context: float) -> float:
        """The engine's step from the formula alone: without the measured points' correction or
        what serving adds (``decode_s`` has both)."""
        memory = (self.streamed_weight_bytes(batch) + total_context * self._kvb) / self._bw
        if self._attn_d_s is None:
            compute = (batch * self._lin_head + total_context * self._attn) / self._flops
        else:
            compute = batch * self._lin_head / self._flops + total_context * self._attn_d_s
        hw = self.hw
        body = max(memory, compute) if hw.overlap else memory + compute
        return hw.step_overhead_s + batch * hw.seq_overhead_s + body + self._allreduce_s(batch)

    def _measured_ratios(self) -> dict[int, tuple[tuple[float, float], ...]]:
        """batch -> ((context, measured / formula), ...) by context, from the profile's decode
        points, when they were measured on this model (at tp 1); else empty: the formula alone."""
        if not self.hw.decode_points or self.tp != 1 or tuple(self.hw.points_model) != self.model.shape:
            return {}
        table: dict[int, list[tuple[float, float]]] = {}
        for batch, context, seconds in self.hw.decode_points:
            table.setdefault(int(batch), []).append(
                (float(context), seconds / self.formula_decode_s(int(batch), batch * context)))
        return {b: tuple(sorted(rows)) for b, rows in table.items()}

    def _ratio(self, batch: int, context: float) -> float:
        """The measured / formula ratio at ``batch`` (the nearest measured batch), linear in
        the context between the measured ones and held at the ends."""
        rows = self._ratios.get(batch)
        if rows is None:  # looked up once per batch size, then kept
            rows = self._ratios[batch] = self._ratios[min(self._ratios, key=lambda b: (abs(b - batch), b))]
        if context <= rows[0][0]:
            return rows[0][1]
        for (c0, r0), (c1, r1) in zip(rows, rows[1:]):
            if context <= c1:
                return r0 + (r1 - r0) * (context - c0) / (c1 - c0) if c1 > c0 else r1
        return rows[-1][1]

    def transfer_s(self, tokens: int, decode_tp: int | None = None) -> float:
        """Moving ``tokens`` of KV from this prefill worker to a decode worker of ``decode_tp``
        ranks (default: this worker's). Each rank pair moves in parallel over its own NICs: by
        head, over min(prefill, decode) ranks' links (the side with fewer ranks moves more
        heads each); MLA's latent whole to every decode rank, so over one link's time."""
        lanes = 1 if self.model.mla else min(self.tp, decode_tp or self.tp)
        return self.hw.kv_transfer_overhead_s + tokens * self.kv_bytes_per_token / (self.hw.kv_link_bw * lanes)

    def tier_load_s(self, tokens: int) -> float:
        """Loading ``tokens`` of a prompt's prefix from the host's KV tier into this worker's
        cache (``pdserve.planner.prefix_cache``): their KV bytes at the profile's tier rate."""
        return tokens * self._kvb / self.hw.kv_tier_bw

    def _allreduce_s(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        nbytes = tokens * self.model.hidden_size * self.hw.dtype_bytes
        if self.tp <= self.hw.devices_per_node:
            bw, latency = self.hw.interconnect_bw, ALLREDUCE_LATENCY_S
        else:  # the ring crosses nodes: each device's NIC carries its share
            bw, latency = min(self.hw.interconnect_bw, self.hw.kv_link_bw), ALLREDUCE_LATENCY_INTERNODE_S
        ring = 2 * (self.tp - 1) / self.tp * nbytes / bw
        return 2 * self.model.num_layers * (ring + latency)


@dataclass(frozen=True)
class FittedStepCost:
    """Step times from a fit to measured steps instead of from FLOPs and bytes, in the form
    DistServe's simulator uses (``simdistserve/estimators/time_estimator.py``), in ms:

    - prefill: a + b * new tokens + c * sum(chunk length ** 2) (the quadratic term: attention);
    - decode: a + b * context tokens of the batch + c * batch, with one (a, b, c) below
      ``large_batch`` sequences and another from it on.

    KV capacity and transfers come from ``base`` (the fit says nothing about them), so a
    simulated worker runs the same rules with the measured engine's step times.
    """

    base: CostModel
    prefill_ms: tuple[float, float, float]
    decode_small_ms: tuple[float, float, float]
    decode_large_ms: tuple[float, float, float]
    large_batch: int = 95

    @property
    def kv_bytes_per_token(self) -> float:
        return self.base.kv_bytes_per_token

    @property
    def hw(self) -> HardwareProfile:
        return self.base.hw

    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens()

    @property
    def tp(self) -> int:
        return self.base.tp

    def transfer_s(self, tokens: int, decode_tp: int | None = None) -> float:
        return self.base.transfer_s(tokens, decode_tp)

    def tier_load_s(self, tokens: int) -> float:
        return self.base.tier_load_s(tokens)

    def prefill_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int = 1) -> float:
        a, b, c = self.prefill_ms
        return (a + b * sum(n for n, _ in chunks) + c * sum(n * n for n, _ in chunks)) / 1e3

    def decode_s(self, batch: int, total_context: float) -> float:
        if batch <= 0:
            return 0.0
        a, b, c = self.decode_small_ms if batch < self.large_batch else self.decode_large_ms
        return (a + b * total_context + c * batch) / 1e3

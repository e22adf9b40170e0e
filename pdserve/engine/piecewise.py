"""Steps with prompt tokens as CUDA graphs, piecewise (``--cuda-graphs``): everything but the
attention replays from graphs, the attention runs eagerly between them.

A decode step replays one graph (pdserve/engine/cuda_graphs.py). A step with prompt tokens
cannot: its attention depends on how the step's tokens split into sequences (a prompt chunk
attends to its own tokens and to what its sequence has cached, a decode row to its cache), which
a graph would freeze. So such a step ran eagerly, and on a GPU that costs more than the step's
work: 8B on an H200 (BENCHMARKS.md, run 8), decode-only steps 7.3 ms, steps with 16 prompt tokens
35.8 ms, the difference the host launching some 1,200 kernels one by one. Everything outside the
attention (the embedding, norms, projections, MLP) treats each token alike, whatever sequence it
belongs to: only the token count matters. So that part is captured once per token count in
``TOKEN_SIZES`` (up to the scheduler's token budget), as one graph per piece between two
attention calls:

- piece 0: the embedding, the RoPE tables, layer 0 up to its q|k|v projection;
- piece i (1 .. L-1): layer i-1 from its attention output on (o_proj, residual add and norm,
  MLP), layer i up to its q|k|v;
- piece L: the last layer's rest and the final norm, to the hidden states.

A step of T tokens pads them to the smallest size S >= T (token 0 at position 0; each token's
rows are computed on their own, so the padding changes no real row), replays piece 0, runs layer
0's attention eagerly over the first T rows with the step's real context (which stores their
K/V in the cache), replays piece 1, and so on. The pieces hand over through static buffers of the
largest size (q|k|v, the attention's output, the residual stream: each piece ends by copying its
two into place), so memory is one piece's working set plus those buffers, not a step's
activations per layer. The LM head runs after, eagerly, on the sampled rows.

Which models: those whose forward is ``CausalLM``'s and whose layers are ``DecoderLayer``s with
Llama's attention (``unsupported`` says why another is not: a family with a forward of its own,
such as Gemma 3's, Granite's or DeepSeek's, runs such steps eagerly), on one rank (gloo cannot be
captured), with a graph-safe attention backend, without an adapter active. A capture that fails
(a layer that syncs with the host, say) leaves every such step eager, logged. On the CPU the same
pieces run without graphs (``capture=False``), which is how tests/engine/test_piecewise.py checks
everything but the capture: the pieces compose to the model's own forward, padded or not.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from pdserve.engine import progress
from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.cuda_graphs import sizes_until
from pdserve.engine.models.decoder import Attention, CausalLM, DecoderLayer, DecoderStack

log = logging.getLogger(__name__)

# Token counts a step with prompt tokens is captured for. A step pads to the next. Below a few
# hundred tokens a GPU's linears are bound by reading the weights, and padding costs little (up
# to twice the tokens here); past them they are bound by compute, so the padding is at most a
# quarter from 256 tokens on (a decode worker's mixed step of 32 rows and a 256-token chunk pads
# 288 to 320). A step larger than the largest runs eagerly: there the launches are a small part.
TOKEN_SIZES = (32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def token_sizes(max_tokens: int) -> tuple[int, ...]:
    """``TOKEN_SIZES`` up to the first that holds ``max_tokens`` (a step's token budget)."""
    return sizes_until(TOKEN_SIZES, max_tokens)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model``'s forward cannot be cut at its attention calls; None when it can."""
    if not isinstance(model, CausalLM) or type(model).forward is not CausalLM.forward:
        return f"{type(model).__name__} has a forward of its own"
    if type(model.stack) is not DecoderStack:
        return "its decoder stack runs as one call"
    for layer in model.layers:
        if type(layer) is not DecoderLayer or not isinstance(layer.self_attn, Attention) \
                or type(layer.self_attn).forward is not Attention.forward:
            return f"its layer {type(layer).__name__} ({type(layer.self_attn).__name__}) is not Llama's"
    shapes = {(layer.self_attn.nh, layer.self_attn.nkv, layer.self_attn.hd) for layer in model.layers}
    if len(shapes) > 1:
        return f"its layers' attention differs in shape ({sorted(shapes)}): one set of hand-over buffers fits one"
    return None


class PiecewiseGraphs:
    """The pieces of one model for each size of ``sizes`` (tokens); ``run`` gives a step's hidden
    states. ``capture=False``: the same pieces and buffers, run eagerly (the CPU, in tests)."""

    def __init__(self, model: CausalLM, sizes: Sequence[int], device: torch.device, capture: bool = True):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"piecewise graphs cannot cut this model: {reason}")
        self.model, self.sizes = model, tuple(sorted(sizes))
        self.replays = 0  # steps served by the pieces, for tests and the step profile
        layers = model.layers
        first = layers[0].self_attn
        largest = self.sizes[-1]
        dtype = model.embed_tokens.weight.dtype
        hidden = model.cfg.hidden_size
        # The hand-over buffers, at the largest size; a smaller size uses their first rows.
        self.qkv = torch.zeros(largest, first.q_size + 2 * first.kv_size, dtype=dtype, device=device)
        self.attn_out = torch.zeros(largest, first.nh, first.hd, dtype=dtype, device=device)
        self.residual = torch.zeros(largest, hidden, dtype=dtype, device=device)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self._sizes: dict[int, _Size] = {}
        pool = None
        for size in reversed(self.sizes):  # the largest first: the others fit in its pool
            pieces = _Size(self, size)
            if capture:
                pieces.capture(pool)
                pool = pieces.pool
            self._sizes[size] = pieces

    def bucket(self, tokens: int) -> int | None:
        """The smallest size that holds a step of ``tokens``; None when none does."""
        return min((s for s in self.sizes if s >= tokens), default=None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor | None:
        """The step's hidden states (T, hidden), a view of a static buffer (read it before the
        next step); None when no size holds T (the caller runs the step eagerly)."""
        t = input_ids.shape[0]
        size = self.bucket(t)
        if size is None:
            return None
        self.input_ids[:t].copy_(input_ids)
        self.input_ids[t:size].zero_()
        self.positions[:t].copy_(positions)
        self.positions[t:size].zero_()
        pieces = self._sizes[size]
        rope = None
        for i, layer in enumerate(self.model.layers):
            pieces.run_piece(i)
            rope = rope or (pieces.rope[0][:t], pieces.rope[1][:t])  # piece 0 has made the tables
            out = layer.self_attn.attend(self.qkv[:t], rope, ctx)
            self.attn_out[:t].copy_(out.reshape(t, *self.attn_out.shape[1:]))
            progress.layer_done()
        pieces.run_piece(len(self.model.layers))
        self.replays += 1
        return pieces.hidden[:t]


class _Size:
    """One token count's pieces: their functions, and their graphs once captured."""

    def __init__(self, owner: PiecewiseGraphs, size: int):
        self.owner, self.size = owner, size
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.hidden: torch.Tensor | None = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.pool = None
        n = len(owner.model.layers)
        self.pieces: list[Callable[[], None]] = [self._first] + [
            (lambda i=i: self._middle(i)) for i in range(1, n)] + [self._last]

    def _hand_over(self, qkv: torch.Tensor, residual: torch.Tensor) -> None:
        self.owner.qkv[:self.size].copy_(qkv)
        self.owner.residual[:self.size].copy_(residual)

    def _first(self) -> None:
        o, model = self.owner, self.owner.model
        h = model.embed_tokens(o.input_ids[:self.size])
        self.rope = model.rotary.tables(o.positions[:self.size], h.dtype)
        x, residual = model.layers[0].norm_in(h, None)
        self._hand_over(model.layers[0].self_attn.project(x), residual)

    def _after(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` from its attention output on: (the MLP's output, residual stream)."""
        o, layer = self.owner, self.owner.model.layers[i]
        attn = layer.self_attn.output(o.attn_out[:self.size], o.residual.dtype)
        return layer.finish(attn, o.residual[:self.size])

    def _middle(self, i: int) -> None:
        layer = self.owner.model.layers[i]
        x, residual = layer.norm_in(*self._after(i - 1))
        self._hand_over(layer.self_attn.project(x), residual)

    def _last(self) -> None:
        model = self.owner.model
        self.hidden = model.norm(*self._after(len(model.layers) - 1))[0]

    def run_piece(self, i: int) -> None:
        if self.graphs is None:
            self.pieces[i]()
        else:
            self.graphs[i].replay()

    def capture(self, pool) -> None:
        """Warm every piece up on a side stream (Triton compiles, cuBLAS picks its kernels, the
        RoPE tables are built), then capture each into one memory pool, in the order they replay."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for piece in self.pieces:
                piece()
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for piece in self.pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                piece()
            pool = graph.pool()
            graphs.append(graph)
        self.graphs, self.pool = graphs, pool

"""CUDA graphs for decode steps (``--cuda-graphs``): a decode step replays one captured graph
instead of launching its kernels one by one.

A decode step of a small model is launch-bound: the SmolLM2 shape queues about 1,250 kernels
a step, each a few microseconds of host work, against a memory floor near 0.1 ms. A graph
replays them all in one call. It replays exactly what it captured, the same shapes and the
same addresses, so:

- One graph per batch size in ``CAPTURE_SIZES`` up to the worker's ``max_num_seqs``
  (``capture_sizes``), all captured at start into one memory pool, largest first. A decode
  step of B sequences replays the smallest graph of at least B rows (``bucket_for``); a step
  larger than the largest, or any step with prompt tokens, runs eagerly.
- Each graph reads its inputs from static device buffers: token ids, positions, slot mapping,
  block tables (as wide as ``max_model_len`` needs) and context lengths, views of one buffer
  that a step fills in one host-to-device copy that the host does not wait for
  (``padded_inputs`` builds its contents on the host). Rows past the batch are padding:
  token 0 at position 0, slot block -1 (the K/V store skips it) and no context (attention
  reads nothing for it), so they touch no block of the cache.
- The attention backend must take every length from device tensors, as the Triton kernels do
  (``graph_safe``); SDPA's per-length groups and flash-attn's host-sized gathers do not. The
  captured context carries no host lengths.

Off by default until a GPU run has shown graphs give the eager step's tokens
(tests/gpu/test_cuda_graphs.py); on a host without CUDA, or with a backend that is not
graph-safe, the setting changes nothing (logged). On the CPU the same buffers and padding run
without a graph (``capture=False``), which is how tests/engine/test_cuda_graphs.py checks
everything but the capture itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pdserve.engine.attention.base import AttentionContext, HostContext
from pdserve.engine.device import pack, unpack

log = logging.getLogger(__name__)

# Decode batch sizes a graph is captured for: with ``--max-num-seqs`` up to 256 (64 by default),
# every decode step the scheduler can form replays one, padded by at most 7 rows up to 64 and by
# under a fifth of the graph above (a padding row costs its share of the attention and sampling, not
# another weight read).
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# A step's forward as a graph captures it: (token ids, positions, context) -> logits (B, V) float32.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionContext], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """``CAPTURE_SIZES`` up to the first that holds ``max_num_seqs`` decode sequences."""
    return sizes_until(CAPTURE_SIZES, max_num_seqs)


def sizes_until(sizes: Sequence[int], most: int) -> tuple[int, ...]:
    """Ascending ``sizes`` up to the first that holds ``most`` (all of them if none does)."""
    out = []
    for size in sizes:
        out.append(size)
        if size >= most:
            break
    return tuple(out)


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``batch`` rows; None when none does."""
    return min((s for s in sizes if s >= batch), default=None)


def padded_inputs(host: HostContext, input_ids: torch.Tensor, size: int, width: int) -> list[torch.Tensor]:
    """A decode step's inputs as a graph of ``size`` rows and block tables ``width`` wide reads
    them, on the host: token ids, positions, slot blocks, slot offsets (size,) int64, block
    tables (size, width) int32, context lengths (size,) int32. Padding rows: token 0 at
    position 0, slot block -1, block table of zeros, no context."""
    c = host.ctx
    b, used = c.block_tables.shape
    if b > size or used > width:
        raise ValueError(f"a decode step of {b} sequences and {used} blocks does not fit a graph of {size} x {width}")

    def rows(t: torch.Tensor, fill: int) -> torch.Tensor:
        out = torch.full((size,), fill, dtype=t.dtype)
        out[:b] = t
        return out

    tables = torch.zeros(size, width, dtype=torch.int32)
    tables[:b, :used] = c.block_tables
    return [rows(input_ids, 0), rows(host.positions, 0), rows(c.slot_block, -1), rows(c.slot_offset, 0), tables,
            rows(c.context_lens_t, 0)]


@dataclass
class _Graph:
    """One captured size: the device buffer its inputs live in, their layout in it, the
    context over them, its output logits, and the graph (None: run eagerly, on the CPU)."""

    buffer: torch.Tensor
    layout: list
    inputs: list[torch.Tensor]  # views of ``buffer``, in ``padded_inputs``' order
    ctx: AttentionContext
    logits: torch.Tensor | None = None
    graph: "torch.cuda.CUDAGraph | None" = None

    def load(self, host_inputs: list[torch.Tensor]) -> None:
        """Fill the static inputs from ``padded_inputs``' tensors: one copy, not waited for."""
        staging, _ = pack(host_inputs, pin=self.buffer.device.type == "cuda")
        self.buffer.copy_(staging, non_blocking=True)


class DecodeGraphs:
    """The graphs of one model runner: ``run`` replays the one that fits a decode step.

    ``forward`` is the step's forward through the logits, its caches and backend bound;
    ``width`` the most blocks a sequence can hold. ``capture=False`` builds the same buffers
    and runs ``forward`` on them without a graph (the CPU, in tests). ``on_replay(size,
    inputs)``: called with a step's padded inputs (on the host) before it replays, for rank 0 of
    a tensor-parallel worker to hand them to the other ranks, which replay their own graphs of
    the same sizes on them (``replay_inputs``)."""

    def __init__(self, forward: Forward, sizes: Sequence[int], width: int, block_size: int, device: torch.device,
                 capture: bool = True, on_replay: Callable[[int, list[torch.Tensor]], None] | None = None):
        self.forward, self.sizes, self.width, self.on_replay = forward, tuple(sorted(sizes)), width, on_replay
        self.replays = 0  # decode steps served by a graph, for tests and the step profile
        self._graphs: dict[int, _Graph] = {}
        pool = None
        for size in sorted(self.sizes, reverse=True):  # the largest first: the others fit in its pool
            graph = self._graphs[size] = _static(size, width, block_size, device)
            if capture:
                graph.graph, graph.logits = _capture(lambda g=graph: self._forward(g), pool)
                pool = graph.graph.pool()

    def _forward(self, graph: _Graph) -> torch.Tensor:
        input_ids, positions = graph.inputs[:2]
        return self.forward(input_ids, positions, graph.ctx)

    def run(self, host: HostContext, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The decode step's logits (B, V) float32, from the smallest graph that holds it;
        None when none does (the caller runs the step eagerly). ``input_ids`` on the host."""
        size = bucket_for(input_ids.shape[0], self.sizes)
        if size is None or host.ctx.block_tables.shape[1] > self.width:
            return None
        inputs = padded_inputs(host, input_ids, size, self.width)
        if self.on_replay is not None:
            self.on_replay(size, inputs)
        graph = self._graphs[size]
        graph.load(inputs)
        return self._replay(graph)[:input_ids.shape[0]]

    def replay_inputs(self, size: int, inputs: list[torch.Tensor]) -> None:
        """Another rank's replay of rank 0's step: ``inputs`` are rank 0's padded inputs, on this
        rank's device; the logits are gathered to rank 0 inside the graph."""
        graph = self._graphs[size]
        for static, value in zip(graph.inputs, inputs):
            static.copy_(value)
        self._replay(graph)

    def _replay(self, graph: _Graph) -> torch.Tensor | None:
        if graph.graph is None:
            graph.logits = self._forward(graph)
        else:
            graph.graph.replay()
        self.replays += 1
        return graph.logits


def _static(size: int, width: int, block_size: int, device: torch.device) -> _Graph:
    """A size's static inputs (all padding) in one device buffer, and the context over them."""
    empty = HostContext(_host_context(0, width, block_size), torch.zeros(0, dtype=torch.long))
    staging, layout = pack(padded_inputs(empty, torch.zeros(0, dtype=torch.long), size, width))
    buffer = staging.to(device)
    inputs = unpack(buffer, layout)
    _, _, slot_block, slot_offset, tables, context_lens = inputs
    cu_query_lens = torch.arange(size + 1, dtype=torch.int32, device=device)  # one query token a row, padding too
    ctx = AttentionContext(is_decode=True, slot_block=slot_block, slot_offset=slot_offset, block_tables=tables,
                           query_lens=[1] * size, context_lens=[], context_lens_t=context_lens,
                           cu_query_lens=cu_query_lens, cu_context_lens=torch.zeros(size + 1, dtype=torch.int32,
                                                                                     device=device),
                           max_context_len=width * block_size, max_query_len=1, block_size=block_size)
    return _Graph(buffer, layout, inputs, ctx)


def _host_context(batch: int, width: int, block_size: int) -> AttentionContext:
    """An empty step's host context (``batch`` 0): what ``padded_inputs`` pads from."""
    empty_long, empty_int = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.int32)
    return AttentionContext(is_decode=True, slot_block=empty_long, slot_offset=empty_long,
                            block_tables=torch.zeros(batch, 0, dtype=torch.int32), query_lens=[], context_lens=[],
                            context_lens_t=empty_int, cu_query_lens=torch.zeros(1, dtype=torch.int32),
                            cu_context_lens=torch.zeros(1, dtype=torch.int32), block_size=block_size)


def _capture(run: Callable[[], torch.Tensor], pool) -> tuple["torch.cuda.CUDAGraph", torch.Tensor]:
    """Warm ``run`` up on a side stream (Triton compiles, cuBLAS picks its kernels, the RoPE
    tables are built: nothing of that may happen inside a capture), then capture it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = run()
    return graph, logits

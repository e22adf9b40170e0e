"""One engine step as rank 0 of a tensor-parallel worker hands it to the other ranks.

Rank 0 schedules and prepares each step's inputs (``ModelRunner.prepare``); every other rank
runs the same forward on its share of the weights and KV heads. So that they need no
scheduler, block manager or sequence, rank 0 broadcasts the prepared tensors themselves: the
token ids, the positions and the ``AttentionContext`` (slot mapping, block tables, lengths).
A block id means the same block on every rank, so the block tables need no translation.

Every rank also computes its vocabulary slice of each logits rank 0 computes (the LM head is
split by vocabulary rows, pdserve/engine/layers/vocab.py), on the same rows and in the same
order, since each is a gather to rank 0:
- the sampled rows': their indices travel with the step (``Step.sample_rows``), and every rank
  computes them right after the forward;
- any further rows (the prompt logprobs' slices, pdserve/engine/runner/prompt_logprobs.py):
  one ``LOGITS`` header each, naming rows [start, stop) of the step's hidden states.

With LoRA (docs/lora.md#tensor-parallelism), a step whose tokens use adapters carries them
too (``Step.lora``): which adapter (by the id rank 0 gave it) sits in each device slot, then each
token's slot, so that every rank fills the same slots and adds the same adapter to each token.
Rank 0 hands every adapter load and unload on as it happens (``LORA_LOAD``: its id, then the
adapter directory's path, which each rank reads itself, as it read its share of the model;
``LORA_UNLOAD``: its id), between two steps, in the order the steps keep.

A step is two broadcasts: a fixed-size header (what comes and its sizes), then one int64
payload holding every tensor end to end; a ``LOGITS`` or ``LORA_UNLOAD`` is one header, a
``LORA_LOAD`` a header and the path's bytes. ``group`` is the worker's process group
(``torch.distributed.ProcessGroup``); the tensors live on the rank's device (NCCL broadcasts
device memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import AttentionContext
from pdserve.engine.lora.mirror import StepLoRA

STOP, STEP, LOGITS, LORA_LOAD, LORA_UNLOAD, GRAPHS, GRAPH_STEP = 0, 1, 2, 3, 4, 5, 6  # header[0]: what follows
# int64 slots: op, T, B, M, is_decode, max_context_len, max_query_len, block_size, S (sampled
# rows), L (LoRA slots; 0: no adapter in the step); a LOGITS header: op, start, stop, then
# zeros; a LORA_LOAD: op, adapter id, the path's length in bytes; a LORA_UNLOAD: op, adapter id;
# a GRAPHS: op, width, block size, capture (0: the buffers alone), the number of sizes; a
# GRAPH_STEP: op, size, width.
_HEADER = 10


@dataclass(frozen=True)
class Step:
    """A step as the other ranks receive it: its inputs, and the rows whose logits rank 0 samples."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    ctx: AttentionContext
    sample_rows: torch.Tensor  # (S,) rows of the step's hidden states; empty: none sampled
    lora: StepLoRA | None = None  # the step's adapters; None: no token uses one


@dataclass(frozen=True)
class LogitsRows:
    """Rows [start, stop) of the latest step's hidden states, whose logits rank 0 computes next."""

    start: int
    stop: int


@dataclass(frozen=True)
class Graphs:
    """Build the decode graphs of ``sizes`` rows, block tables ``width`` wide, as rank 0 does now
    (pdserve/engine/cuda_graphs.py): captured (NCCL) or the static buffers alone."""

    sizes: tuple[int, ...]
    width: int
    block_size: int
    capture: bool


@dataclass(frozen=True)
class GraphStep:
    """Replay the decode graph of ``size`` rows on ``inputs`` (``cuda_graphs.padded_inputs``' order
    and dtypes, on this rank's device)."""

    size: int
    inputs: list[torch.Tensor]


@dataclass(frozen=True)
class LoRALoad:
    """Rank 0 loaded the adapter at ``path`` under id ``adapter_id``."""

    adapter_id: int
    path: str


@dataclass(frozen=True)
class LoRAUnload:
    """Rank 0 unloaded adapter ``adapter_id``."""

    adapter_id: int


def send_step(group, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
              sample_rows: torch.Tensor, lora: StepLoRA | None = None) -> None:
    """Rank 0: hand the step's prepared inputs to the other ranks (T tokens, B sequences,
    block tables of width M, S sampled rows, L LoRA slots)."""
    device = input_ids.device
    b, m = ctx.block_tables.shape
    lora_parts = [] if lora is None else [lora.table.to(device), lora.slots.to(device)]
    header = torch.tensor([STEP, input_ids.shape[0], b, m, int(ctx.is_decode), ctx.max_context_len,
                           ctx.max_query_len, ctx.block_size, sample_rows.shape[0],
                           0 if lora is None else lora.table.shape[0]], dtype=torch.long, device=device)
    lens = torch.tensor([*ctx.query_lens, *ctx.context_lens], dtype=torch.long, device=device)  # (2B,)
    payload = torch.cat([input_ids, positions, ctx.slot_block, ctx.slot_offset,
                         ctx.block_tables.flatten().long(), lens, sample_rows.long(), *lora_parts])
    group.broadcast(header, 0).wait()
    group.broadcast(payload, 0).wait()


def send_lora_load(group, adapter_id: int, path: str, device: torch.device) -> None:
    """Rank 0: it loaded the adapter at ``path`` (a directory every rank reads) as ``adapter_id``."""
    data = path.encode()
    header = torch.tensor([LORA_LOAD, adapter_id, len(data)] + [0] * (_HEADER - 3), dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()
    group.broadcast(torch.tensor(list(data), dtype=torch.uint8, device=device), 0).wait()


def send_lora_unload(group, adapter_id: int, device: torch.device) -> None:
    """Rank 0: it unloaded adapter ``adapter_id``."""
    header = torch.tensor([LORA_UNLOAD, adapter_id] + [0] * (_HEADER - 2), dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()


def send_logits(group, start: int, stop: int, device: torch.device) -> None:
    """Rank 0: it computes the logits of rows [start, stop) of the step's hidden states next."""
    header = torch.tensor([LOGITS, start, stop] + [0] * (_HEADER - 3), dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()


def send_graphs(group, sizes: tuple[int, ...], width: int, block_size: int, capture: bool,
                device: torch.device) -> None:
    """Rank 0: it builds its decode graphs now; the others build the same, in the same order."""
    header = torch.tensor([GRAPHS, width, block_size, int(capture), len(sizes)] + [0] * (_HEADER - 5),
                          dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()
    group.broadcast(torch.tensor(sizes, dtype=torch.long, device=device), 0).wait()


def send_graph_step(group, size: int, inputs: list[torch.Tensor], device: torch.device) -> None:
    """Rank 0: it replays its graph of ``size`` rows on ``inputs`` (``padded_inputs``, on the host)."""
    width = inputs[4].shape[1]
    header = torch.tensor([GRAPH_STEP, size, width] + [0] * (_HEADER - 3), dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()
    group.broadcast(torch.cat([t.flatten().long() for t in inputs]).to(device), 0).wait()


def _graph_step(group, size: int, width: int, device: torch.device) -> GraphStep:
    payload = torch.empty(5 * size + size * width, dtype=torch.long, device=device)
    group.broadcast(payload, 0).wait()
    ids, positions, slot_block, slot_offset, tables, context_lens = payload.split([size] * 4 + [size * width, size])
    return GraphStep(size, [ids, positions, slot_block, slot_offset, tables.view(size, width).to(torch.int32),
                            context_lens.to(torch.int32)])


def send_stop(group, device: torch.device) -> None:
    """Rank 0: the worker is stopping; the other ranks leave their loop."""
    group.broadcast(torch.zeros(_HEADER, dtype=torch.long, device=device), 0).wait()


def receive(group, device: torch.device) -> Step | LogitsRows | LoRALoad | LoRAUnload | Graphs | GraphStep | None:
    """Another rank: wait for rank 0's next message: a step, rows to compute logits for, an
    adapter loaded or unloaded, graphs to build or replay, or None when the worker stops."""
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()
    op, t, b, m, is_decode, max_context, max_query, block_size, s, num_slots = header.tolist()
    if op == STOP:
        return None
    if op == LOGITS:
        return LogitsRows(start=t, stop=b)
    if op == LORA_UNLOAD:
        return LoRAUnload(adapter_id=t)
    if op == GRAPH_STEP:
        return _graph_step(group, t, b, device)
    if op == GRAPHS:
        sizes = torch.empty(is_decode, dtype=torch.long, device=device)  # header[4]: how many
        group.broadcast(sizes, 0).wait()
        return Graphs(tuple(sizes.tolist()), width=t, block_size=b, capture=bool(m))
    if op == LORA_LOAD:
        data = torch.empty(b, dtype=torch.uint8, device=device)
        group.broadcast(data, 0).wait()
        return LoRALoad(adapter_id=t, path=bytes(data.tolist()).decode())
    lora_len = num_slots + t if num_slots else 0
    payload = torch.empty(4 * t + b * m + 2 * b + s + lora_len, dtype=torch.long, device=device)
    group.broadcast(payload, 0).wait()
    input_ids, positions, slot_block, slot_offset, tables, lens, sample_rows, lora = payload.split(
        [t, t, t, t, b * m, 2 * b, s, lora_len])
    q_lens, c_lens = lens[:b].to(torch.int32), lens[b:].to(torch.int32)
    cu_query = torch.zeros(b + 1, dtype=torch.int32, device=device)
    torch.cumsum(q_lens, 0, out=cu_query[1:])
    cu_context = torch.zeros(b + 1, dtype=torch.int32, device=device)
    torch.cumsum(c_lens, 0, out=cu_context[1:])
    ctx = AttentionContext(
        is_decode=bool(is_decode), slot_block=slot_block, slot_offset=slot_offset,
        block_tables=tables.view(b, m).to(torch.int32), query_lens=q_lens.tolist(), context_lens=c_lens.tolist(),
        context_lens_t=c_lens, cu_query_lens=cu_query, cu_context_lens=cu_context,
        max_context_len=max_context, max_query_len=max_query, block_size=block_size)
    step_lora = StepLoRA(*lora.split([num_slots, t])) if num_slots else None
    return Step(input_ids, positions, ctx, sample_rows, step_lora)

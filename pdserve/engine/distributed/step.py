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

A step is two broadcasts: a fixed-size header (what comes and its sizes), then one int64
payload holding every tensor end to end; a ``LOGITS`` is one header. ``group`` is the worker's
process group (``torch.distributed.ProcessGroup``); the tensors live on the rank's device
(NCCL broadcasts device memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import AttentionContext

STOP, STEP, LOGITS = 0, 1, 2  # header[0]: what follows
# int64 slots: op, T, B, M, is_decode, max_context_len, max_query_len, block_size, S (sampled
# rows); a LOGITS header: op, start, stop, then zeros.
_HEADER = 9


@dataclass(frozen=True)
class Step:
    """A step as the other ranks receive it: its inputs, and the rows whose logits rank 0 samples."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    ctx: AttentionContext
    sample_rows: torch.Tensor  # (S,) rows of the step's hidden states; empty: none sampled


@dataclass(frozen=True)
class LogitsRows:
    """Rows [start, stop) of the latest step's hidden states, whose logits rank 0 computes next."""

    start: int
    stop: int


def send_step(group, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
              sample_rows: torch.Tensor) -> None:
    """Rank 0: hand the step's prepared inputs to the other ranks (T tokens, B sequences,
    block tables of width M, S sampled rows)."""
    device = input_ids.device
    b, m = ctx.block_tables.shape
    header = torch.tensor([STEP, input_ids.shape[0], b, m, int(ctx.is_decode), ctx.max_context_len,
                           ctx.max_query_len, ctx.block_size, sample_rows.shape[0]], dtype=torch.long, device=device)
    lens = torch.tensor([*ctx.query_lens, *ctx.context_lens], dtype=torch.long, device=device)  # (2B,)
    payload = torch.cat([input_ids, positions, ctx.slot_block, ctx.slot_offset,
                         ctx.block_tables.flatten().long(), lens, sample_rows.long()])
    group.broadcast(header, 0).wait()
    group.broadcast(payload, 0).wait()


def send_logits(group, start: int, stop: int, device: torch.device) -> None:
    """Rank 0: it computes the logits of rows [start, stop) of the step's hidden states next."""
    header = torch.tensor([LOGITS, start, stop] + [0] * (_HEADER - 3), dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()


def send_stop(group, device: torch.device) -> None:
    """Rank 0: the worker is stopping; the other ranks leave their loop."""
    group.broadcast(torch.zeros(_HEADER, dtype=torch.long, device=device), 0).wait()


def receive(group, device: torch.device) -> Step | LogitsRows | None:
    """Another rank: wait for rank 0's next message: a step, rows to compute logits for, or
    None when the worker stops."""
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()
    op, t, b, m, is_decode, max_context, max_query, block_size, s = header.tolist()
    if op == STOP:
        return None
    if op == LOGITS:
        return LogitsRows(start=t, stop=b)
    payload = torch.empty(4 * t + b * m + 2 * b + s, dtype=torch.long, device=device)
    group.broadcast(payload, 0).wait()
    input_ids, positions, slot_block, slot_offset, tables, lens, sample_rows = payload.split(
        [t, t, t, t, b * m, 2 * b, s])
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
    return Step(input_ids, positions, ctx, sample_rows)

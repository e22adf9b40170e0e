"""One engine step as rank 0 of a tensor-parallel worker hands it to the other ranks.

Rank 0 schedules and prepares each step's inputs (``ModelRunner.prepare``); every other rank
runs the same forward on its share of the weights and KV heads. So that they need no
scheduler, block manager or sequence, rank 0 broadcasts the prepared tensors themselves: the
token ids, the positions and the ``AttentionContext`` (slot mapping, block tables, lengths).
A block id means the same block on every rank, so the block tables need no translation.

Two broadcasts a step: a fixed-size header (what comes and its sizes), then one int64 payload
holding every tensor end to end. ``group`` is the worker's process group
(``torch.distributed.ProcessGroup``); the tensors live on the rank's device (NCCL broadcasts
device memory).
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionContext

STOP, STEP = 0, 1  # header[0]: what follows
_HEADER = 8  # int64 slots: op, T, B, M, is_decode, max_context_len, max_query_len, block_size


def send_step(group, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> None:
    """Rank 0: hand the step's prepared inputs to the other ranks (T tokens, B sequences,
    block tables of width M)."""
    device = input_ids.device
    b, m = ctx.block_tables.shape
    header = torch.tensor([STEP, input_ids.shape[0], b, m, int(ctx.is_decode), ctx.max_context_len,
                           ctx.max_query_len, ctx.block_size], dtype=torch.long, device=device)
    lens = torch.tensor([*ctx.query_lens, *ctx.context_lens], dtype=torch.long, device=device)  # (2B,)
    payload = torch.cat([input_ids, positions, ctx.slot_block, ctx.slot_offset,
                         ctx.block_tables.flatten().long(), lens])
    group.broadcast(header, 0).wait()
    group.broadcast(payload, 0).wait()


def send_stop(group, device: torch.device) -> None:
    """Rank 0: the worker is stopping; the other ranks leave their loop."""
    group.broadcast(torch.zeros(_HEADER, dtype=torch.long, device=device), 0).wait()


def receive(group, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionContext] | None:
    """Another rank: wait for rank 0's next step; (input_ids, positions, context), or None
    when the worker stops."""
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    group.broadcast(header, 0).wait()
    op, t, b, m, is_decode, max_context, max_query, block_size = header.tolist()
    if op == STOP:
        return None
    payload = torch.empty(4 * t + b * m + 2 * b, dtype=torch.long, device=device)
    group.broadcast(payload, 0).wait()
    input_ids, positions, slot_block, slot_offset, tables, lens = payload.split([t, t, t, t, b * m, 2 * b])
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
    return input_ids, positions, ctx

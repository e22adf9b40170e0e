"""KV by head between tensor-parallel workers: which heads each rank's cache holds (``KVShard``),
which bytes of a block one rank pair moves (``HeadSlice``), and which holder ranks a reader rank
reads (``read_plan``). Pure: plain values in, frozen dataclasses out; no I/O.

A worker of tensor-parallel size P splits the model's H KV heads over its ranks: rank r holds
heads [r*H/P, (r+1)*H/P) of every token (``pdserve.engine.parallel``), and a block id names the
same tokens on every rank. A block is ``block_size * rows_per_token`` *rows*, each row one token's K
or V of one layer (``pdserve.engine.attention.kv_cache`` orders them layer-major: a layer's K rows
for the block's tokens, then its V rows, then the next layer's), each row the rank's heads in
head order. So a range of heads is contiguous within a row, and a row is ``head_count *
head_bytes`` bytes; what moves between sizes does not depend on the rows' order, only that both
sides share it.

A prefill pool of size P and a decode pool of size D, one dividing the other. Decode rank s:
- D == P: reads whole blocks of prefill rank s: the single-rank path, one descriptor a block;
- D > P: prefill rank s // (D/P) holds its heads; of each row it keeps its H/D heads at their
  offset, into its own contiguous rows;
- D < P: prefill ranks s*P/D .. (s+1)*P/D - 1 hold them; from each it takes whole rows into its
  slice of its own rows.
Each rank pair is one read. ``HeadSlice`` says which bytes of each row move where; how they move
is the backend's: over NIXL the holder's blocks whole into staging and then the rows' slices in
place (``pdserve.kv_transfer.staged``: a descriptor a row would cost UCX more than the bytes),
over tcp the holder sends the slices and the reader writes them in place. A read that names a
last block's first bytes (``last_block_bytes``) moves only those rows; the engine's blocks are
layer-major and always move whole (``CacheSpec.tail_bytes``).

Why not a head-major block (heads outside tokens) to make a head range contiguous: what it
would save is one copy on the reader, between sizes only (staging reads whole blocks at the
same descriptor count as equal sizes do; measured: ``benchmarks/kv_by_head.py``, BENCHMARKS.md),
and decode attention reads a head's keys no faster than from layer-major rows (the same
measurement that chose layer-major, BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from pdserve.kv_transfer.errors import InvalidTransferRequest
from pdserve.protos import kv_transfer_pb2

__all__ = ["HeadSlice", "KVShard", "RankRead", "check_sizes", "checksum_groups_for", "head_slice", "read_plan"]


@dataclass(frozen=True)
class KVShard:
    """One rank's share of a worker's KV cache: its heads, and the byte shape of a block."""

    tp_rank: int
    tp_size: int
    num_kv_heads: int  # the model's, all ranks together
    head_start: int
    head_count: int
    head_bytes: int  # one head of one row: head_dim x the dtype's size
    rows_per_token: int  # 2 x layers (K and V); one per layer for a latent cache
    block_size: int  # tokens per block
    dtype: str  # torch's name, "bfloat16"
    checksum_groups: int = 1  # the holder sums each block's rows in this many equal groups of heads

    @classmethod
    def of_rank(cls, tp_rank: int, tp_size: int, *, num_kv_heads: int, head_bytes: int, rows_per_token: int,
                block_size: int, dtype: str, checksum_groups: int = 1, replicated: bool = False) -> KVShard:
        """Rank ``tp_rank`` of ``tp_size``: its contiguous 1/``tp_size`` of the heads, or all of them
        when ``replicated`` (a cache every rank holds whole, such as a latent one)."""
        if tp_size < 1 or (not replicated and num_kv_heads % tp_size):
            raise InvalidTransferRequest(f"num_kv_heads ({num_kv_heads}) is not divisible by tp_size ({tp_size})",
                                         field="tp_size", limit=num_kv_heads)
        count = num_kv_heads if replicated else num_kv_heads // tp_size
        shard = cls(tp_rank, tp_size, num_kv_heads, 0 if replicated else tp_rank * count, count, head_bytes,
                    rows_per_token, block_size, dtype, checksum_groups)
        shard.check()
        return shard

    @property
    def head_stop(self) -> int:
        return self.head_start + self.head_count

    @property
    def row_bytes(self) -> int:
        return self.head_count * self.head_bytes

    @property
    def block_rows(self) -> int:
        return self.block_size * self.rows_per_token

    @property
    def block_bytes(self) -> int:
        return self.block_rows * self.row_bytes

    @property
    def replicated(self) -> bool:
        """Every rank holds every head (nothing to split, such as a latent cache)."""
        return self.head_count == self.num_kv_heads

    def rank(self, tp_rank: int) -> KVShard:
        """The same worker's shard of rank ``tp_rank``."""
        start = self.head_start if self.replicated else tp_rank * self.head_count
        return dataclasses.replace(self, tp_rank=tp_rank, head_start=start)

    def check(self) -> None:
        """Raise InvalidTransferRequest naming the field and its limit if the shard cannot be."""
        for name in ("tp_size", "num_kv_heads", "head_count", "head_bytes", "rows_per_token", "block_size",
                     "checksum_groups"):
            if getattr(self, name) < 1:
                raise InvalidTransferRequest(f"shard {name} must be >= 1, got {getattr(self, name)}",
                                             field=name, limit=1)
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidTransferRequest(f"shard tp_rank {self.tp_rank} is not in [0, tp_size={self.tp_size})",
                                         field="tp_rank", limit=self.tp_size)
        if not 0 <= self.head_start < self.head_stop <= self.num_kv_heads:
            raise InvalidTransferRequest(
                f"shard heads [{self.head_start}, {self.head_stop}) are not within the model's {self.num_kv_heads}",
                field="head_start", limit=self.num_kv_heads)
        if self.head_count % self.checksum_groups:
            raise InvalidTransferRequest(
                f"checksum_groups {self.checksum_groups} does not divide the shard's {self.head_count} heads",
                field="checksum_groups", limit=self.head_count)

    def to_proto(self) -> kv_transfer_pb2.KVShard:
        return kv_transfer_pb2.KVShard(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, p: kv_transfer_pb2.KVShard) -> KVShard:
        shard = cls(**{f.name: getattr(p, f.name) for f in dataclasses.fields(cls)})
        shard.check()
        return shard


def checksum_groups_for(holder_tp: int, reader_tp: int) -> int:
    """The checksum groups a holder of size ``holder_tp`` needs so that every rank of a reader
    of size ``reader_tp`` can check what it reads: one per reader rank sharing a holder rank."""
    check_sizes(holder_tp, reader_tp)
    return max(1, reader_tp // holder_tp)


def check_sizes(holder_tp: int, reader_tp: int) -> None:
    """Raise InvalidTransferRequest naming both sizes unless one divides the other."""
    if holder_tp < 1 or reader_tp < 1 or (holder_tp % reader_tp and reader_tp % holder_tp):
        raise InvalidTransferRequest(
            f"the holder's (prefill) tensor-parallel size {holder_tp} and the reader's (decode) size "
            f"{reader_tp} do not divide one another: KV moves by head only between sizes where one "
            "divides the other", field="tp_size", limit=holder_tp)


def check_compatible(reader: KVShard, holder: KVShard) -> None:
    """Raise InvalidTransferRequest naming the field and both values where the two caches do not
    hold the same model's KV in the same shape, or their sizes do not divide one another."""
    check_sizes(holder.tp_size, reader.tp_size)
    for name in ("num_kv_heads", "head_bytes", "rows_per_token", "block_size", "dtype"):
        mine, theirs = getattr(reader, name), getattr(holder, name)
        if mine != theirs:
            raise InvalidTransferRequest(
                f"KV shard {name} mismatch: the holder's is {theirs!r}, this reader's {mine!r}; both pools "
                "must serve the same model with the same block size and dtype", field=name, limit=mine)


@dataclass(frozen=True)
class HeadSlice:
    """The bytes of each block one rank pair moves: of each row, ``length`` bytes at
    ``src_offset`` of the holder's row (``src_row`` bytes) land at ``dst_offset`` of the reader's
    row (``dst_row`` bytes). A block has as many rows on either side. ``group_bytes``: the bytes
    of one of the holder's checksum groups, ``first_group`` the index of the slice's first; 0
    when the slice does not fall on group boundaries (it cannot be checked)."""

    rows_per_token: int
    block_rows: int
    src_row: int
    src_offset: int
    dst_row: int
    dst_offset: int
    length: int
    group_bytes: int
    first_group: int

    @property
    def whole_rows(self) -> bool:
        """Whole rows on both sides: a block is contiguous on both, one descriptor a block."""
        return self.length == self.src_row == self.dst_row

    @property
    def groups(self) -> int:
        """How many of the holder's checksum sums cover one block of this slice (0: none fits)."""
        return self.length // self.group_bytes if self.group_bytes else 0

    def last_rows(self, last_block_bytes: int) -> int:
        """The rows of the last block a read moves, from its bytes in the reader's block."""
        token_bytes = self.rows_per_token * self.dst_row
        if last_block_bytes % token_bytes or not 0 < last_block_bytes <= self.block_rows * self.dst_row:
            raise InvalidTransferRequest(
                f"last_block_bytes {last_block_bytes} is not a whole number of tokens of {token_bytes} bytes "
                f"in (0, {self.block_rows * self.dst_row}]", field="last_block_bytes", limit=token_bytes)
        return last_block_bytes // self.dst_row

    def nbytes(self, num_blocks: int, last_rows: int) -> int:
        """Bytes a read of ``num_blocks`` blocks moves, its last one ``last_rows`` rows."""
        return ((num_blocks - 1) * self.block_rows + last_rows) * self.length


def head_slice(reader: KVShard, holder: KVShard) -> Optional[HeadSlice]:
    """What ``reader`` reads of each of ``holder``'s blocks: the heads both hold. None when the
    reader holds exactly the holder's heads and the holder sums whole blocks: a plain block read.
    Raises InvalidTransferRequest if the caches do not fit (``check_compatible``) or share no head."""
    check_compatible(reader, holder)
    start, stop = max(reader.head_start, holder.head_start), min(reader.head_stop, holder.head_stop)
    if start >= stop:
        raise InvalidTransferRequest(
            f"holder rank {holder.tp_rank} of {holder.tp_size} holds heads [{holder.head_start}, {holder.head_stop}) and "
            f"reader rank {reader.tp_rank} of {reader.tp_size} heads [{reader.head_start}, {reader.head_stop}): "
            "none in common", field="tp_rank", limit=holder.tp_size)
    if (start, stop) == (holder.head_start, holder.head_stop) == (reader.head_start, reader.head_stop) \
            and holder.checksum_groups == 1:
        return None
    hb = holder.head_bytes
    group_heads = holder.head_count // holder.checksum_groups
    aligned = (start - holder.head_start) % group_heads == 0 and (stop - holder.head_start) % group_heads == 0
    return HeadSlice(
        rows_per_token=holder.rows_per_token, block_rows=holder.block_rows, src_row=holder.row_bytes,
        src_offset=(start - holder.head_start) * hb, dst_row=reader.row_bytes,
        dst_offset=(start - reader.head_start) * hb, length=(stop - start) * hb,
        group_bytes=group_heads * hb if aligned else 0,
        first_group=(start - holder.head_start) // group_heads if aligned else 0)


@dataclass(frozen=True)
class RankRead:
    """One rank pair of a transfer: reader rank ``reader.tp_rank`` reads heads [start, stop) of
    holder rank ``holder.tp_rank``. ``part`` of ``parts``: its place among every pair of the
    transfer (all reader ranks together); the holder's lease ends once every part's last read
    has landed (``pdserve.kv_transfer.handoff.ReadNotice``)."""

    reader: KVShard
    holder: KVShard
    start: int
    stop: int
    part: int
    parts: int

    @property
    def slice(self) -> Optional[HeadSlice]:
        return head_slice(self.reader, self.holder)

    @property
    def sums_per_block(self) -> int:
        """How many checksums the holder worker sends per block: every rank's groups."""
        return self.holder.tp_size * self.holder.checksum_groups

    def checksums(self, sums: Sequence[int], start_block: int, end_block: int) -> Optional[tuple[int, ...]]:
        """Of the holder worker's checksums (``sums_per_block`` a block, rank by rank, in block
        order), those this pair checks for blocks [start_block, end_block); None where ``sums``
        does not cover them. Raises InvalidTransferRequest if the holder's checksum groups do not
        fall on this pair's heads (field ``checksum_groups``, limit the groups it needs)."""
        per_block = self.sums_per_block
        if len(sums) < end_block * per_block:
            return None
        hs = self.slice
        first, count = (0, 1) if hs is None else (hs.first_group, hs.groups)
        if count == 0:
            raise InvalidTransferRequest(
                f"holder rank {self.holder.tp_rank} sums its {self.holder.head_count} heads in "
                f"{self.holder.checksum_groups} groups; reader rank {self.reader.tp_rank} reads heads "
                f"[{self.start}, {self.stop}) of them and needs groups of at most {self.stop - self.start}",
                field="checksum_groups", limit=self.holder.head_count // (self.stop - self.start))
        base = self.holder.tp_rank * self.holder.checksum_groups + first
        return tuple(s for b in range(start_block, end_block)
                     for s in sums[b * per_block + base:b * per_block + base + count])


def _sources(reader: KVShard, holders: Sequence[KVShard]) -> list[tuple[KVShard, int, int]]:
    """The holder ranks that hold ``reader``'s heads, in head order, and the range each gives.
    Where several hold a head (a replicated cache) the reader takes rank ``tp_rank`` mod their
    number, so the readers spread over the holders."""
    out, at = [], reader.head_start
    while at < reader.head_stop:
        having = [h for h in holders if h.head_start <= at < h.head_stop]
        if not having:
            raise InvalidTransferRequest(f"no holder rank holds head {at}", field="head_start", limit=at)
        pick = having[reader.tp_rank % len(having)]
        stop = min(reader.head_stop, pick.head_stop)
        out.append((pick, at, stop))
        at = stop
    return out


def read_plan(reader: KVShard, holders: Sequence[KVShard]) -> tuple[RankRead, ...]:
    """The reads of reader rank ``reader`` from a holder worker whose ranks are ``holders``
    (``holders[r]`` is rank r's shard): one per holder rank that holds some of its heads.
    Raises InvalidTransferRequest naming the field and the limit if the holder's ranks are not
    0 .. tp_size - 1 of one worker, or do not fit the reader (``check_compatible``)."""
    size = len(holders)
    for r, h in enumerate(holders):
        if (h.tp_rank, h.tp_size, h.checksum_groups) != (r, size, holders[0].checksum_groups):
            raise InvalidTransferRequest(
                f"holder rank {r} announces rank {h.tp_rank} of {h.tp_size} with {h.checksum_groups} checksum "
                f"groups; a worker of {size} ranks announces ranks 0 .. {size - 1}, each with the same groups",
                field="tp_rank", limit=size)
        check_compatible(reader, h)
    before = sum(len(_sources(reader.rank(s), holders)) for s in range(reader.tp_rank))
    parts = before + sum(len(_sources(reader.rank(s), holders)) for s in range(reader.tp_rank, reader.tp_size))
    return tuple(RankRead(reader, h, start, stop, before + i, parts)
                 for i, (h, start, stop) in enumerate(_sources(reader, holders)))

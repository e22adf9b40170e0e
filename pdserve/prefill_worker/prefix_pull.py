"""The reversed pull, the prefill worker's side: before a prompt is scheduled, read the part
of its prefix that a decode worker holds for it (``PrefillRequest.prefix``, held by
``pdserve.decode_worker.prefix_hold``) and this worker's own prefix cache lacks, so that the
prompt's prefill finds the whole prefix cached and computes only the suffix.

The prefix's life here, on the engine thread:

1. ``pin``: the prefix's full blocks are allocated under a sequence of their own (the *pin*),
   with this worker's own prefix cache first: its hits are kept, and fresh blocks take the
   rest. The fresh blocks are PENDING (``pdserve.engine.core.block_manager``): nothing finds them.
2. The holder's lease is claimed (on the loop, ``PrefixSource.claim``), then ``start`` reads
   the blocks past the own hits from the holder into the fresh ones, each checked against the
   holder's checksum when it lands; the read's notice ends the holder's lease.
3. ``poll`` (a hook): once every read is DONE and verified, the pin's blocks are marked final,
   and only now findable; a read that failed frees the pin, and nothing it wrote is findable.
   Either way the request's stream hears ``PrefixPulled``, and the prompt is queued.
4. The prompt's own allocation finds the prefix in the cache; the hook then frees the pin
   (until then it keeps the blocks from eviction). ``drop`` frees it on every other exit.

A prefix that could not be read changes nothing but time: the prompt is computed whole, to
the same tokens. Refused (the prompt is computed whole, the lease released, counted as a
failed transfer): prompts that want prompt logprobs (every position must run). Refused unread
and counted (``kv_unverified_refused``): a prefix held without checksums while this worker
verifies (``verify_kv``); such blocks are never read, so never marked final nor published.

Tensor-parallel workers on either side read as the KV transfer does: each of this worker's
ranks reads its KV heads from the holder ranks that hold them (``RankAgents.start``,
``pdserve.kv_transfer.sharding``) into the same block ids, and the pin is final only once every
rank's read has landed and passed its checksums.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from pdserve.engine.errors import CacheCapacityError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer import InvalidTransferRequest, TransferHandle, TransferState
from pdserve.kv_transfer.handoff import KVHandle
from pdserve.kv_transfer.rank_agents import RankAgents, RankSources
from pdserve.shell.read_quarantine import ReadQuarantine
from pdserve.wire import worker_metrics

log = logging.getLogger(__name__)

# While a prefix read is in flight the engine thread checks on it this often; while a pin
# waits for its prompt's allocation, at the same pace (the prompt is queued: steps run anyway).
PULL_POLL_S = 0.0005


@dataclass(frozen=True)
class PrefixPulled:
    """Pushed to a request's stream when its prefix read has ended: ``tokens`` of its prompt
    are final here now (0: the read failed, ``error`` says why)."""

    tokens: int
    nbytes: int = 0
    error: str | None = None


@dataclass
class _Read:
    pin: str  # the pin's sequence id in the block manager
    tokens: list[int]  # what the pin holds: the prefix's full blocks and one token more
    num_final: int  # tokens the prefix's blocks hold once read
    local: list[int]  # the pin's block ids
    own: int  # of them, the leading blocks this worker's cache had (final already)
    handles: list[TransferHandle] = field(default_factory=list)


@dataclass(frozen=True)
class MetricLabels:
    """The labels a prefix read's bytes and seconds are observed under (``worker_metrics``)."""

    worker_id: str
    backend: str
    model_name: str


class PrefixPulls:
    """The prefix reads of one prefill worker; every method runs on its engine thread."""

    def __init__(self, engine: LLMEngine, agent: RankAgents, push: Callable[[Iterable[tuple[str, Any]]], None],
                 labels: MetricLabels, verify_kv: bool):
        self.engine, self.agent, self.push = engine, agent, push
        self.labels, self.verify_kv = labels, verify_kv
        self.quarantine = ReadQuarantine(agent, engine.blocks)  # blocks of stopped reads, until they are over
        self._reads: dict[str, _Read] = {}  # request -> its prefix, from ``pin`` until its prompt has blocks
        self.bytes_read = 0  # KV bytes this worker read from decode workers' prefixes
        self.tokens_read = 0  # ... and the prompt tokens they hold (WorkerStats.prefix_tokens_read)
        self.refused = 0  # prefixes offered and not read (WorkerStats.prefix_reads_refused)
        self.unverified = 0  # ... of them, held without checksums while this worker verifies (kv_unverified_refused)

    def pin(self, request_id: str, prompt: list[int], cache_salt: str, kv: KVHandle) -> tuple[int, int]:
        """Pin the prefix ``kv`` holds (step 1 of the module docstring): returns how many of
        its blocks this worker's cache had, and how many to read. (0, 0): nothing to do (the
        handle covers no full block of the prompt before its last, or no block is free)."""
        bs = self.engine.blocks.block_size
        n = min(len(kv.block_ids), kv.num_tokens // bs, (len(prompt) - 1) // bs)
        if n <= 0:
            return 0, 0
        pin = f"{request_id}\0prefix"  # request ids are unique here while their record lives
        tokens = list(prompt[:n * bs + 1])  # one token past the prefix: all n blocks may hit
        try:
            alloc = self.engine.blocks.allocate(pin, tokens, cache_salt=cache_salt, count=False)  # the prompt's counts
        except CacheCapacityError:
            self.refused += 1
            return 0, 0
        hit = alloc.num_cached_tokens // bs
        self._reads[request_id] = _Read(pin, tokens, n * bs, list(alloc.block_ids), hit)
        return hit, n - hit

    def start(self, request_id: str, kv: KVHandle, peer: RankSources) -> None:
        """Start reading the pinned prefix's blocks past the own hits (step 2); the read's
        notice ends the holder's lease. Raises InvalidTransferRequest (the pin is freed) where
        the handle does not fit this cache, and UnverifiedTransfer (nothing read) where this
        worker verifies and the holder sent no checksums for them: fail closed, as a decode
        worker's read."""
        read = self._reads[request_id]
        bs = self.engine.blocks.block_size
        try:
            read.handles = self.agent.start(peer, kv.block_ids, read.local, read.own, read.num_final // bs,
                                            lease_token=kv.lease_token, last=True,
                                            sums=kv.block_checksums if self.verify_kv else None)
        except InvalidTransferRequest:
            self.drop(request_id)
            raise

    def poll(self) -> float | None:
        """Hook (step 3 and 4): end the reads that ended, and free the pins whose prompt has its
        blocks now; release the blocks of stopped reads now over. How long until the next look
        (None: nothing pinned or quarantined)."""
        wait = self.quarantine.poll()
        if not self._reads:
            return wait
        ended = []
        for request_id, read in list(self._reads.items()):
            if not read.handles:  # no read (started yet): a pin waiting for its prompt's blocks
                if self.engine.blocks.has(request_id):
                    self._free(request_id)
                continue
            ended.extend(self._check(request_id, read))
        if ended:
            self.push(ended)
        return PULL_POLL_S if self._reads else wait

    def _check(self, request_id: str, read: _Read) -> list[tuple[str, PrefixPulled]]:
        states = [self.agent.poll(h) for h in read.handles]
        failed = next((h for h, s in zip(read.handles, states) if s.is_terminal and s is not TransferState.DONE), None)
        if failed is not None:
            self.drop(request_id)
            log.warning("request %s: reading its prefix failed (%s: %s); computing the whole prompt",
                        request_id, failed.state.name.lower(), failed.error)
            return [(request_id, PrefixPulled(0, error=f"{failed.state.name.lower()}: {failed.error}"))]
        if not all(s is TransferState.DONE for s in states):
            return []
        # Verified (each read checked its blocks' checksums as they landed): final, findable.
        self.engine.blocks.mark_final(read.pin, read.tokens, read.num_final)
        nbytes = sum(h.nbytes for h in read.handles)
        seconds = max(h.finished_at for h in read.handles) - min(h.started_at for h in read.handles)
        worker_metrics.kv_transfer_done("prefill", self.labels.worker_id, self.labels.backend, seconds, nbytes,
                                        sum(h.descriptors for h in read.handles), self.labels.model_name)
        self.bytes_read += nbytes
        self.tokens_read += read.num_final - read.own * self.engine.blocks.block_size
        read.handles = []  # the pin now waits for the prompt's allocation
        return [(request_id, PrefixPulled(read.num_final, nbytes))]

    def drop(self, request_id: str) -> None:
        """The request leaves, or its prefix is not to be read: cancel its read and free its pin,
        but the blocks the read may still write stay quarantined until it is over."""
        read = self._reads.pop(request_id, None)
        if read is not None:
            landing = self.quarantine.stop(read.handles)
            self.engine.blocks.free(read.pin, quarantine=landing.blocks)
            self.quarantine.hold(landing)

    def _free(self, request_id: str) -> None:
        read = self._reads.pop(request_id, None)
        if read is not None:
            self.engine.blocks.free(read.pin)

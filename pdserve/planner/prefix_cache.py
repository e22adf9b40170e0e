"""A simulated worker's prefix cache, and the KV tier below it (``pdserve/engine/kv_tier/``), on
counts: shared prefixes (a trace's ``prefix_hash``) and how many full blocks of each are kept.

The worker's level (``PrefixCache``): an index of prefixes, least recently used first, bounded
by half the worker's blocks (the real cache keeps a freed block findable until its memory is
handed out again; half the cache stands for what running sequences leave free). A prompt whose
prefix is there skips the prefix's full blocks (the engine always computes the last prompt
token); a prompt whose prefix is not is computed whole, and its prefix enters the index at
admission (a prompt arriving while the first one computes also hits, where the real cache
would have the blocks only once computed). The oldest entries leave when the bound is passed.

The KV tier (``HostTier``), one per host, shared by every worker placed on it as the engine's
tier directory is: an entry leaving a worker's index moves there (the engine's ``offload`` of a
block whose memory is handed out again), bounded by ``kv_offload_bytes``, least recently used
out first. A prompt whose prefix misses the worker's index but is in the tier loads those
blocks (the engine's ``load``: read from the store and verified) instead of computing them: the
worker pays ``CostModel.tier_load_s`` in the step that admits it, and the prefix enters the
worker's index again (the tier keeps its copy, touched). The hit rate is whatever this LRU
gives over the request stream: a working set revisited in a cycle longer than the tier holds
hits nothing, as a real LRU store would.

Granularity: a prefix's blocks move together (a whole prefix hits or misses), where the real
cache and store keep or lose single blocks of a chain; a prefix larger than the whole tier is
not kept there (its first blocks would leave before its last arrived). The tier counts block
bytes only (a stored block's header of magic, version, tokens and checksum is a few hundred
bytes beside 368,640 of SmolLM2's KV).

Hosts (``HostTiers``): workers fill hosts of ``devices_per_node`` devices (the profile's) in the
order they start, as a placement packs them; each host has one tier. The CPU profile's 8 puts a
layout of up to 8 one-core workers on one host.

``PrefixHits`` is the worker's side: the hit of a prompt whose blocks it allocates, and the tier
loads the step it sets up pays.
"""

from __future__ import annotations

from collections import OrderedDict


class HostTier:
    """The KV tier of one host: prefix -> blocks kept, least recently used first."""

    def __init__(self, capacity_bytes: int, block_bytes: float):
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.capacity_blocks = int(capacity_bytes // block_bytes)
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used_blocks = 0
        self.blocks_offloaded = 0  # blocks that came in (a prefix already kept is only touched)
        self.blocks_loaded = 0  # blocks given back to a worker

    @property
    def bytes_used(self) -> float:
        return self.used_blocks * self.block_bytes

    def offload(self, prefix_hash: str, blocks: int) -> None:
        """A worker's index dropped ``prefix_hash`` (``blocks`` full blocks): keep them."""
        kept = self.entries.get(prefix_hash, 0)
        if kept:
            self.entries.move_to_end(prefix_hash)
        if blocks <= kept or blocks > self.capacity_blocks:
            return  # kept as long already, or larger than the whole tier
        self.entries[prefix_hash] = blocks  # (a shorter copy of it is replaced in place, at the end)
        self.used_blocks += blocks - kept
        self.blocks_offloaded += blocks - kept
        while self.used_blocks > self.capacity_blocks:  # never the newest: it fits alone
            _, gone = self.entries.popitem(last=False)
            self.used_blocks -= gone

    def load(self, prefix_hash: str, blocks: int) -> int:
        """Up to ``blocks`` full blocks of ``prefix_hash`` for a worker: how many it kept (0: none)."""
        kept = self.entries.get(prefix_hash)
        if not kept:
            return 0
        self.entries.move_to_end(prefix_hash)
        n = min(kept, blocks)
        self.blocks_loaded += n
        return n


class HostTiers:
    """The tiers of a simulated cluster's hosts (module docstring), made as workers start."""

    def __init__(self, capacity_bytes: int, block_bytes: float, devices_per_node: int):
        self.capacity_bytes, self.block_bytes, self.devices_per_node = capacity_bytes, block_bytes, devices_per_node
        self.tiers: list[HostTier] = []
        self._free = 0  # devices left on the newest host

    def place(self, devices: int) -> HostTier:
        """A worker of ``devices`` devices starts: the tier of the host it lands on."""
        if devices > self._free:
            self.tiers.append(HostTier(self.capacity_bytes, self.block_bytes))
            self._free = max(self.devices_per_node, devices)
        self._free -= devices
        return self.tiers[-1]


class PrefixCache:
    """One worker's prefix index (module docstring), over ``tier`` when its host has one."""

    def __init__(self, capacity_blocks: int, block_size: int, tier: HostTier | None = None):
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.tier = tier
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used_blocks = 0

    def __contains__(self, prefix_hash: str) -> bool:
        return prefix_hash in self.entries

    def match(self, prefix_hash: str, cached_blocks: int) -> tuple[int, int]:
        """A prompt of ``prefix_hash`` whose first ``cached_blocks`` full blocks may come from
        cache: (tokens the worker's index gives, tokens the tier gives). It enters the index."""
        entries, bs = self.entries, self.block_size
        if prefix_hash in entries:
            entries.move_to_end(prefix_hash)
            return cached_blocks * bs, 0
        tier_tokens = self.tier.load(prefix_hash, cached_blocks) * bs if self.tier is not None else 0
        entries[prefix_hash] = cached_blocks
        self.used_blocks += cached_blocks
        while self.used_blocks > self.capacity_blocks:
            gone, blocks = entries.popitem(last=False)
            self.used_blocks -= blocks
            if self.tier is not None:
                self.tier.offload(gone, blocks)
        return 0, tier_tokens


class PrefixHits:
    """``SimWorker``'s side of its prefix cache (kept apart, as ``MixedSteps`` is): a prompt's hit
    when its blocks are allocated, and the tier loads its next step pays."""

    def _prefix_hit(self, seq) -> None:
        """Full blocks of a cached shared prefix are not recomputed (the last token always is);
        those the host's KV tier gives back are loaded in the step instead."""
        if not (self.limits.enable_prefix_cache and seq.prefix_hash):
            return
        cached_blocks = min(seq.prefix_tokens, seq.tokens - 1) // self.limits.block_size
        device, tier = self.prefix_cache.match(seq.prefix_hash, cached_blocks)
        hit = device + tier
        seq.todo -= hit
        self.queued_tokens -= hit
        if tier:
            self._load_s += self.cost.tier_load_s(tier)
        if not seq.recompute:
            seq.device_hit, seq.tier_hit = device, tier

    def _take_load(self) -> float:
        """The KV tier loads of the prompts just admitted: the step being set up pays them (the
        engine loads a block on its own thread while it allocates, before the step runs)."""
        load, self._load_s = self._load_s, 0.0
        return load

"""A worker's ``WorkerStats`` snapshot, read without stopping the engine thread.

The reads race with the engine thread by design (a step can take seconds; the router's
poll must not wait for it): each field is a single Python read under the GIL, so values
are individually consistent, and the snapshot as a whole is at most one step old.
"""

from __future__ import annotations

from pdserve.engine.attention.kv_cache import LatentCacheSpec
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.core.scheduler import Scheduler
from pdserve.kv_transfer.rank_agents import RankAgents
from pdserve.protos import worker_pb2
from pdserve.shell import lora_rpcs


def worker_stats(worker_id: str, role: str, engine: LLMEngine, agent: RankAgents, metrics_address: str = "",
                 engine_steps: int = 0, **extra) -> worker_pb2.WorkerStats:
    """The snapshot; ``metrics_address`` is where the worker serves /metrics, ``engine_steps``
    the engine thread's progress: its steps and the decoder layers computed inside them
    (pdserve/engine/progress.py; with ``engine_busy`` it tells a hung engine from an idle one:
    ``pdserve.router.liveness``), ``extra`` the role's own fields (leases on a prefill worker)."""
    sched = engine.scheduler
    waiting = list(sched.waiting)
    t = agent.stats.snapshot()
    blocks = engine.blocks
    return worker_pb2.WorkerStats(
        worker_id=worker_id, role=role,
        num_running=len(sched.running) + len(sched.awaiting_kv), num_waiting=len(waiting),
        # prompt tokens still to compute: queued, or in the step now running (a prefill worker
        # packs a burst's prompts into one step, so its queue empties long before they finish)
        num_waiting_tokens=sum(s.num_tokens - s.num_computed_tokens for s in waiting + list(sched.stepping)),
        num_blocks_total=blocks.num_blocks, num_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
        kv_quarantined_blocks=blocks.num_quarantined,  # counted in num_blocks_used too: not free
        num_blocks_unbounded=unbounded_blocks(engine),
        num_forward_tokens=engine.runner.num_forward_tokens,
        kv_transfer_bytes=t.bytes, kv_transfers=t.transfers, kv_transfer_failures=t.failures,
        kv_verify_failures=t.verify_failures,
        kv_transfer_seconds=t.seconds, prefix_cache_queries=blocks.prefix_queries,
        prefix_cache_hits=blocks.prefix_hits, kv_bytes_per_token=kv_bytes_per_token(engine),
        num_preemptions=sched.num_preemptions, metrics_address=metrics_address, engine_steps=engine_steps,
        engine_busy=engine.has_runnable(), local_prefill_token_s=local_prefill_token_s(sched),
        lora_enabled=engine.config.lora is not None, **lora_rpcs.held_fields(engine),
        **spec_fields(engine), **tier_fields(engine), **extra)


def tier_fields(engine: LLMEngine) -> dict:
    """The KV tier's counters (``KVTier.stats``) and the block manager's tokens found there as
    ``WorkerStats`` fields; none where the engine has no tier (no ``--kv-offload-bytes``), so
    an empty ``kv_tier_id`` says so to the router."""
    tier = engine.kv_tier
    if tier is None:
        return {}
    t = tier.stats()
    return {"kv_tier_id": t.tier_id, "kv_tier_bytes_used": t.bytes_used, "kv_tier_capacity_bytes": t.capacity_bytes,
            "kv_tier_blocks_offloaded": t.blocks_offloaded, "kv_tier_blocks_loaded": t.blocks_loaded,
            "prefix_cache_tier_hits": engine.blocks.tier_hits, "kv_tier_corrupt_blocks": t.corrupt_blocks}


def spec_fields(engine: LLMEngine) -> dict:
    """The engine's speculation counters (``LLMEngine.spec_stats``) as ``WorkerStats`` fields;
    none where it does not speculate (a prefill worker, or no ``--speculative-config``)."""
    spec, counted = engine.config.speculative, engine.spec_stats
    if spec is None or counted is None:
        return {}
    # Kept before proposed, read in that order: a step recorded between two reads then adds only
    # to the later count, so what a scrape reads never keeps more tokens than were proposed.
    per_pos, accepted = list(counted.accepted_per_pos), counted.num_accepted_tokens
    return {"spec_accepted_per_pos": per_pos, "spec_num_accepted_tokens": accepted,
            "spec_num_draft_tokens": counted.num_draft_tokens, "spec_num_drafts": counted.num_drafts,
            "spec_num_speculative_tokens": spec.num_speculative_tokens}


def local_prefill_token_s(sched: Scheduler) -> float:
    """Wall seconds a prompt token prefilled here costs beside the streams, as this worker's
    step budget measured it; 0 while it has measured nothing, or sizes no chunk by time (a
    prefill worker, a fixed chunk): the router then weighs a local prefill by its configured
    slowdown (docs/routing.md#prefill-that-keeps-up)."""
    budget = sched.step_budget
    if budget is None:
        return 0.0
    return budget.prompt_token_s() or 0.0


def unbounded_blocks(engine: LLMEngine) -> int:
    """Blocks held by running sequences whose limit is the context's end (a client that set no
    max_tokens): the ones the scheduler preempts first, so room for a request with a limit."""
    running = list(engine.scheduler.running)
    return sum(len(engine.blocks.block_table(s.seq_id)) for s in running
               if s.num_prompt_tokens + s.params.max_tokens >= engine.max_model_len and engine.blocks.has(s.seq_id))


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """A token's KV in the whole worker: every rank's share of the heads, or, for a latent cache
    that every rank holds whole (MLA), one copy."""
    spec = engine.cache_spec
    return spec.bytes_per_token * (1 if isinstance(spec, LatentCacheSpec) else engine.tensor_parallel_size)

"""A worker's KV-transfer agents, from its engine: one per tensor-parallel rank, each over the
rank's cache and announcing the rank's ``KVShard`` (which heads it holds, the byte shape of a
block), so that a peer of another tensor-parallel size reads it by head.

The shard is where model knowledge meets the transfer layer, and the only place: the KV
heads, head bytes and rows a token has come from the engine's model config and cache spec;
``pdserve.kv_transfer`` sees bytes and heads only.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.attention.kv_cache import LatentCacheSpec
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.kv_transfer import create_agent
from pdserve.kv_transfer.rank_agents import RankAgents, rank_agent_name
from pdserve.kv_transfer.remote_agent import RemoteAgent
from pdserve.kv_transfer.sharding import KVShard, checksum_groups_for
from pdserve.shell.rank_follower import RANK_ENTRY


def kv_shard(engine: LLMEngine, rank: int, checksum_groups: int = 1) -> KVShard:
    """Rank ``rank``'s share of ``engine``'s worker's KV cache. A latent cache (MLA,
    ``LatentCacheSpec``) is one "head" of the latent's bytes a row, a row per layer, that every
    rank holds whole (replicated): a reader rank reads whole blocks of one holder rank, so one
    checksum a block serves it."""
    spec, cfg = engine.cache_spec, engine.model_cfg
    if isinstance(spec, LatentCacheSpec):
        return KVShard.of_rank(rank, engine.tensor_parallel_size, num_kv_heads=1,
                               head_bytes=spec.latent_dim * spec.dtype.itemsize, rows_per_token=spec.num_layers,
                               block_size=spec.block_size, dtype=str(spec.dtype).removeprefix("torch."),
                               replicated=True)
    return KVShard.of_rank(rank, engine.tensor_parallel_size, num_kv_heads=cfg.num_kv_heads,
                           head_bytes=spec.head_dim * spec.dtype.itemsize, rows_per_token=2 * spec.num_layers,
                           block_size=spec.block_size, dtype=str(spec.dtype).removeprefix("torch."),
                           checksum_groups=checksum_groups)


def worker_engine(config: EngineConfig) -> LLMEngine:
    """A worker's engine: its tensor-parallel ranks run ``RANK_ENTRY``, each serving its own KV
    agent (``worker_agents``); no detokenizing (the router does it)."""
    return LLMEngine.from_config(config, detokenize=False, follower_entry=RANK_ENTRY)


def worker_agents(backend: str, worker_id: str, engine: LLMEngine, reader_tp: int = 1, **opts: Any) -> RankAgents:
    """The agents of ``engine``'s ranks: rank 0's in this process over its cache, and each other
    rank's created in that rank's process over its own (``RemoteAgent``: the engine's ranks run
    ``RANK_ENTRY``), on the CPU as on CUDA. ``reader_tp``: the tensor-parallel size of the
    workers that read this one's KV (the decode pool's, for a prefill worker): it sets how many
    checksum groups a block gets, so each reader rank checks the heads it reads. ``opts``:
    ``create_agent``'s."""
    size = engine.tensor_parallel_size
    groups = checksum_groups_for(size, reader_tp)
    ranks = engine.ranks
    if ranks is not None and ranks.entry != RANK_ENTRY:
        raise InvalidRequestError("follower_entry", f"the engine's ranks run {ranks.entry}, which serves no KV-transfer "
                                  f"agent; a worker's engine starts them with {RANK_ENTRY}", 1)
    agents: list = []
    try:
        agents.append(create_agent(backend, rank_agent_name(worker_id, 0), engine.kv_cache,
                                   shard=kv_shard(engine, 0, groups), **opts))
        for rank, sock in enumerate(ranks.service_sockets if ranks is not None else (), start=1):
            agents.append(RemoteAgent.create(sock, backend, rank_agent_name(worker_id, rank),
                                             kv_shard(engine, rank, groups), **opts))
    except Exception:
        for agent in agents:
            agent.close()
        raise
    return RankAgents(agents)

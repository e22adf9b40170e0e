"""Served clusters whose workers run several tensor-parallel ranks (tests/serving/test_tensor_parallel.py
and test_cross_tp_served.py), in float32, and what their tests send: prompts prefilled in chunks
of CHUNK tokens, KV streamed for prompts of STREAMED tokens or more."""

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tests.serving.conftest import start_cluster

MAX_TOKENS = 24
CHUNK, STREAMED = 16, 32
LONG = ("Write a long story about a lighthouse keeper who finds a message in a bottle, and tell it in three "
        "parts: the storm, the bottle, and the answer he sends back across the sea.")  # ~45 tokens: 3 chunks


def tp_cluster(model_dir, tp: int = 2, scheduler: SchedulerConfig = SchedulerConfig(), decode_tp: int | None = None,
               **overrides):
    """A float32 cluster of ``model_dir`` whose prefill workers run ``tp`` ranks and decode
    workers ``decode_tp`` (default: ``tp``)."""
    engine = EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(memory_budget_bytes=64 << 20),
                          scheduler=scheduler)
    return start_cluster(engine=engine, prefill_tp=tp, decode_tp=tp if decode_tp is None else decode_tp, **overrides)

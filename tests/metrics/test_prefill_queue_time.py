"""The prefill worker splits a prompt's time into queue and compute: queue time ends when the
prompt's first chunk runs, whether it runs in one step or in several."""

import asyncio
import random

import pytest

from pdserve.engine.sampling.params import SamplingParams
from pdserve.prefill_worker.worker import PrefillWorker
from tests.factories import make_engine, prefill_worker_config

CHUNK = 128


@pytest.fixture
def worker(tiny_llama_dir):
    model_dir, _ = tiny_llama_dir
    engine = make_engine(model_dir, num_blocks=256, max_num_batched_tokens=CHUNK)
    w = PrefillWorker(prefill_worker_config(kv_transfer_backend="tcp"), engine=engine)
    w.start()
    yield w
    w.stop()


def test_a_chunked_prompt_queues_only_until_its_first_chunk_and_the_next_waits_behind_it(worker):
    rng = random.Random(0)
    long_prompt = [rng.randrange(3, 512) for _ in range(8 * CHUNK)]  # 8 steps of one chunk each
    short_prompt = [rng.randrange(3, 512) for _ in range(40)]

    async def both():
        return await asyncio.gather(worker.prefill("long", long_prompt, SamplingParams(max_tokens=4)),
                                    worker.prefill("short", short_prompt, SamplingParams(max_tokens=4)))

    first, second = asyncio.run(both())
    # The long prompt started at once: its queue is a small part of its 8 chunks.
    assert 0 <= first.queue_seconds < 0.5 * first.seconds
    # Every step was full of the long prompt's chunks: the short one waited for all of them
    # (about ``first.seconds``; the bounds leave room for a busy machine's scheduling).
    assert second.queue_seconds > 0.5 * first.seconds
    assert second.queue_seconds < second.seconds

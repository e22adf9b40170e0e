"""A scheduler on a block manager, with no model: sequences to add and hand-built outputs to feed
it (tests/engine/test_scheduler.py and the policies built on it)."""

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.core.scheduler import SampledTokens, Scheduler
from pdserve.engine.core.sequence import Sequence


def make(num_blocks=64, block_size=4, max_len=1000, **cfg):
    bm = BlockManager(num_blocks, block_size, enable_prefix_cache=False)
    return Scheduler(SchedulerConfig(**cfg), bm, max_len, eos_token_ids=(2,)), bm


def seq(sid, n, max_tokens=8, **kw):
    return Sequence(sid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, **kw))


def feed(sched, out, token=5):
    """Pretend the model sampled ``token`` for every sequence that samples this step."""
    return sched.update_from_output(out, SampledTokens({s.seq.seq_id: token for s in out.seqs if s.sample}))

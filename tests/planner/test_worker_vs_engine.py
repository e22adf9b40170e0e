"""The simulated worker and the engine's own Scheduler + BlockManager take the same steps.

Both get the same requests at once; the real scheduler runs one step at a time on token
lists, the simulated one in decode epochs. The sequence of (prefill batch, decode batch
size) per step must match, and every request must finish at the same step.
"""

import pytest

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.core.scheduler import SampledTokens, Scheduler
from pdserve.engine.core.sequence import Sequence
from pdserve.planner.worker import EngineLimits, SimSeq, SimWorker
from tests.planner.helpers import cost


def real_steps(reqs, limits: EngineLimits, num_blocks: int):
    sched = Scheduler(SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens, True),
                      BlockManager(num_blocks, limits.block_size, enable_prefix_cache=False), max_model_len=100_000)
    for rid, (prompt, output) in enumerate(reqs):
        ids = [1000 * (rid + 1) + i for i in range(prompt)]
        sched.add(Sequence(str(rid), ids, SamplingParams(max_tokens=output, ignore_eos=True)))
    steps, finished_at = [], {}
    while sched.num_unfinished:
        out = sched.schedule()
        if out.is_prefill:
            steps.append(("prefill", tuple((int(s.seq.seq_id), s.num_new_tokens) for s in out.seqs)))
        else:
            steps.append(("decode", len(out.seqs)))
        done = sched.update_from_output(out, SampledTokens({s.seq.seq_id: 7 for s in out.seqs if s.sample}))
        for s in done:
            finished_at[int(s.seq_id)] = len(steps)
    return steps, finished_at, sched.num_preemptions


def sim_steps(reqs, limits: EngineLimits, num_blocks: int):
    w = SimWorker("w", "colocated", cost(), limits, num_blocks=num_blocks)
    for rid, (prompt, output) in enumerate(reqs):
        w.add_prompt(SimSeq(rid, rid, prompt, output))
    steps, finished_at, now = [], {}, 0.0
    while not w.idle():
        now = w.start(now)
        batch = tuple((s.rid, n) for s, n in w._batch)
        b, k, kind = len(w.running), w._k, w._kind
        out = w.finish()
        steps += [("prefill", batch)] if kind == "prefill" else [("decode", b)] * k
        for s in out.finished:
            finished_at[s.rid] = len(steps)
    return steps, finished_at, w.preemptions


@pytest.mark.parametrize("seed", range(5))
def test_same_steps_as_the_real_scheduler(seed):
    import random

    rng = random.Random(seed)
    reqs = [(rng.randint(1, 700), rng.randint(1, 60)) for _ in range(12)]
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=512, block_size=16)
    real = real_steps(reqs, limits, num_blocks=4096)
    assert sim_steps(reqs, limits, num_blocks=4096) == real
    assert real[2] == 0


def test_under_memory_pressure_both_preempt_and_finish_everything():
    reqs = [(100, 120)] * 6
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=2048, block_size=16)
    real, sim = real_steps(reqs, limits, num_blocks=40), sim_steps(reqs, limits, num_blocks=40)
    assert real[2] > 0 and sim[2] > 0
    assert set(real[1]) == set(sim[1]) == set(range(6))
    decode_tokens = lambda steps: sum(x for kind, x in steps if kind == "decode")
    assert decode_tokens(sim[0]) == pytest.approx(decode_tokens(real[0]), rel=0.25)

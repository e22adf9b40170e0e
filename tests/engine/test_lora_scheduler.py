"""The scheduler's limit on adapters a step (pdserve/engine/core/scheduler.py): no step holds more
than ``max_loras`` distinct adapters; the base model needs no slot. Pure, on hand-built outputs."""

from pdserve.engine.config import LoRAConfig
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.scheduler import Scheduler
from tests.helpers.scheduler import feed, seq


def make(max_loras: int, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(64, 4, enable_prefix_cache=False), 1000, (2,),
                     lora=LoRAConfig(max_loras=max_loras))


def ids(out) -> list[str]:
    return [item.seq.seq_id for item in out.seqs]


def test_a_prompt_past_the_limit_waits_and_those_behind_it_go():
    sched = make(1)
    for sid, name in [("a1", "a"), ("b1", "b"), ("base", ""), ("a2", "a")]:
        sched.add(seq(sid, 5, lora_name=name))
    out = sched.schedule()
    assert ids(out) == ["a1", "base", "a2"]
    assert [s.seq_id for s in sched.waiting] == ["b1"]  # first in line once a's sequences end
    feed(sched, out)


def test_running_sequences_of_too_many_adapters_take_turns():
    """KV that arrived from prefill workers puts sequences of two adapters in the batch of a
    one-slot engine: each step decodes one adapter's rows (and the base model's), in turns."""
    sched = make(1)
    for sid, name in [("a", "a"), ("b", "b"), ("base", "")]:
        s = seq(sid, 5, max_tokens=10, lora_name=name)
        s.token_ids.append(7)
        s.num_prompt_tokens = 5
        sched.add_remote_prefilled(s)
        sched.kv_ready(sid)
    steps = []
    for _ in range(4):
        out = sched.schedule()
        steps.append(sorted(ids(out)))
        feed(sched, out)
    assert steps == [["a", "base"], ["b", "base"], ["a", "base"], ["b", "base"]]


def test_without_lora_nothing_changes():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4, enable_prefix_cache=False), 1000, (2,))
    for sid, name in [("a1", "a"), ("b1", "b"), ("c1", "c")]:
        sched.add(seq(sid, 5, lora_name=name))
    assert ids(sched.schedule()) == ["a1", "b1", "c1"]

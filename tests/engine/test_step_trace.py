"""The step trace: one line per engine step with the shape the planner's cost model takes
(prompt chunks with the tokens cached before them, the decode batch and its KV), timed as
``pdserve profile`` times a step. Real engine (tiny random Llama) on its real thread."""

import threading

from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.core.step_trace import StepShape, StepTrace, read, trace_path
from tests.factories import make_engine, random_prompts


def run_traced(engine, prompts, max_tokens, path):
    """Serve ``prompts`` on an engine thread with a trace at ``path``; the traced steps."""
    done = threading.Event()
    left = set(range(len(prompts)))

    def on_outputs(outputs):
        for o in outputs:
            if o.finished:
                left.discard(int(o.request_id))
        if not left:
            done.set()

    thread = EngineThread(engine, on_outputs, step_trace=StepTrace(path))
    thread.start()
    try:
        thread.call(lambda: [engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
                             for i, p in enumerate(prompts)]).result(timeout=30)
        assert done.wait(60)
    finally:
        thread.stop()
    return list(read(path))


def test_each_step_is_traced_with_its_chunks_its_decode_batch_and_its_kv(tiny_llama_dir, tmp_path):
    engine = make_engine(tiny_llama_dir[0], max_num_batched_tokens=32)
    steps = run_traced(engine, random_prompts(2, [40, 20], seed=3), 4, trace_path(tmp_path, "decode-0"))
    shapes = [s.shape for s in steps]
    # 60 prompt tokens in chunks of at most 32: the 40-token prompt in two, the second chunk
    # after the 32 tokens already in the cache; the 20-token prompt where the budget has room
    assert shapes[0] == StepShape(((32, 0),), 0, 0, 0)
    assert shapes[1] == StepShape(((8, 32), (20, 0)), 0, 0, 2)
    # then both decode: 3 more tokens each, every step's KV two tokens more than the last's
    assert [s.decode_batch for s in shapes[2:]] == [2, 2, 2]
    assert [s.decode_context for s in shapes[2:]] == [60, 62, 64]
    assert all(s.sampled == 2 and not s.prefill for s in shapes[2:])
    assert steps[0].after_idle and not any(s.after_idle for s in steps[1:])  # no wait between them
    assert all(s.seconds > 0 for s in steps)
    # the thread's own CPU time: recorded, and never more than the step's wall time
    assert all(s.cpu_seconds is not None and 0 <= s.cpu_seconds <= s.seconds + 1e-3 for s in steps)
    assert all(a.end <= b.start for a, b in zip(steps, steps[1:]))  # in order, no overlap
    assert engine.keep_step_shape


def test_without_a_trace_a_step_records_nothing(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0])
    engine.add_request("a", random_prompts(1, [10])[0], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.last_step_shape is None


def test_a_line_cut_short_is_skipped_and_a_restart_appends(tiny_llama_dir, tmp_path):
    path = trace_path(tmp_path, "prefill-0")
    engine = make_engine(tiny_llama_dir[0])
    first = run_traced(engine, random_prompts(1, [12], seed=1), 2, path)
    with open(path, "a") as f:
        f.write('{"t": 1.0, "s": 0.0')  # a worker killed mid-line
    second = run_traced(engine, random_prompts(1, [14], seed=2), 2, path)
    assert len(second) == len(first) * 2  # the restart's steps follow the first run's
    assert second[len(first)].shape.prefill == ((14, 0),)

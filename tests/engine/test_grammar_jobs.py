"""Grammars compile off the engine thread (``pdserve.engine.sampling.grammar_jobs``): a request with a
spec joins the batch once its grammar is compiled, the streams already running step on while
it compiles, and a compile past its deadline ends its request with an error naming the field
and the limit. Slow compiles are injected (``held_compiles``: each waits for the test's word),
as no spec the router lets through takes long enough to watch."""

import json
import threading
import time

import pytest

from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.sampling.grammar import GrammarCompiler, GrammarKind, StructuredOutput
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine

SCHEMA = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}))
CONSTRAINED = SamplingParams(max_tokens=24, structured=SCHEMA)
FREE = SamplingParams(max_tokens=400, ignore_eos=True)
WAIT_S = 60.0  # how long a test waits for what must happen before it calls it a failure


@pytest.fixture
def engine(tool_llama):
    return make_engine(tool_llama[0], tokenizer=tool_llama[1], policy="mixed")


@pytest.fixture
def held_compiles(monkeypatch):
    """Every compile waits until the returned event is set, and notes the thread it ran on."""
    release, threads = threading.Event(), []
    compile_ = GrammarCompiler.compile

    def held(self, so, field="structured_output"):
        threads.append(threading.current_thread().name)
        release.wait(WAIT_S)
        return compile_(self, so, field)

    monkeypatch.setattr(GrammarCompiler, "compile", held)
    release.threads = threads
    yield release
    release.set()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def prompt(tool_llama, text: str = "Give me JSON:") -> list[int]:
    return tool_llama[1].encode(text)


def test_running_streams_step_on_while_a_grammar_compiles(engine, tool_llama, held_compiles):
    outputs: dict[str, list] = {}
    thread = EngineThread(engine, lambda outs: [outputs.setdefault(o.request_id, []).append(o) for o in outs])
    thread.start()
    try:
        thread.call(engine.add_request, "free", prompt(tool_llama, "Once upon a time"), FREE).result(WAIT_S)
        wait_for(lambda: "free" in outputs, "the free stream's first token")
        thread.call(engine.add_request, "json", prompt(tool_llama), CONSTRAINED).result(WAIT_S)
        steps = thread.steps
        wait_for(lambda: thread.steps >= steps + 5, "steps while the grammar compiles")
        assert "json" not in outputs and not held_compiles.is_set()
        held_compiles.set()
        wait_for(lambda: any(o.finished for o in outputs.get("json", ())), "the constrained request's end")
    finally:
        held_compiles.set()
        thread.stop()
    assert held_compiles.threads and all(name.startswith("grammar") for name in held_compiles.threads)
    text = tool_llama[1].decode([t for o in outputs["json"] for t in o.new_token_ids if t != 2])
    assert set(json.loads(text)) == {"ok"}


def test_a_compile_past_its_deadline_ends_its_request_naming_the_field_and_the_limit(engine, tool_llama,
                                                                                      held_compiles):
    engine.grammars.deadline_s = 0.2
    engine.add_request("free", prompt(tool_llama, "Once upon a time"), SamplingParams(max_tokens=3))
    engine.add_request("json", prompt(tool_llama), CONSTRAINED)
    last = {}
    wait_for(lambda: last.update({o.request_id: o for o in engine.step()}) or "json" in last, "the deadline")
    error = last["json"].error
    assert last["json"].finish_reason == "error" and error.field == "structured_output" and error.limit == 0.2
    assert "did not compile within 0.2 s" in str(error)
    held_compiles.set()
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(engine, tool_llama, held_compiles):
    engine.add_request("json", prompt(tool_llama), CONSTRAINED)
    assert engine.has_unfinished() and not engine.has_runnable()
    assert engine.abort("json") and not engine.has_unfinished()
    held_compiles.set()
    assert engine.generate([prompt(tool_llama)], CONSTRAINED)[0].finish_reason == "stop"


def test_prefilled_kv_waits_for_its_grammar_and_a_grammar_that_fails_waits_for_the_kv(engine, tool_llama,
                                                                                        held_compiles):
    """A decode worker's request: its blocks are written by a transfer while its grammar
    compiles. It decodes once both are done; if its grammar fails first, it ends only once
    its KV has landed (freeing blocks a read is still writing would hand them to another)."""
    free, brace = engine.num_free_blocks, tool_llama[1].encode("{")[0]  # a first token the grammar allows
    engine.add_prefilled("ok", prompt(tool_llama), brace, CONSTRAINED)
    engine.kv_ready("ok")  # KV first: it waits for its grammar
    assert "ok" in engine.grammars and not engine.scheduler.running and not engine.has_runnable()
    held_compiles.set()
    outs = engine.step()  # nothing else to run: the step waits for the compile, then decodes
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].new_token_ids) == 1
    engine.abort("ok")

    engine.grammars.deadline_s = 0.0  # its grammar fails at once, before its KV lands
    engine.add_prefilled("late", prompt(tool_llama), brace, CONSTRAINED)
    wait_for(lambda: engine.step() == [] and "late" not in engine.grammars, "the compile's end")
    assert engine.num_free_blocks < free  # its read may still be writing them
    engine.kv_ready("late")
    (out,) = engine.step()
    assert out.finish_reason == "error" and out.error.field == "structured_output"
    assert engine.num_free_blocks == free and not engine.has_unfinished()

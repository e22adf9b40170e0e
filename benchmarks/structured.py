"""Structured-output overhead: decode step time (TPOT) with and without a JSON schema, and
the per-token mask cost of the grammar libraries, measured in one run on this machine.

    .venv/bin/python benchmarks/structured.py                  # TPOT, batches 1 and 8, and the libraries
    .venv/bin/python benchmarks/structured.py --batches 1 --rounds 3 --no-libraries
    .venv/bin/python benchmarks/structured.py --itl --no-tpot --no-libraries   # a new schema per request

TPOT: the default model in-process (``LLMEngine``, bfloat16, one torch thread, as a worker
runs), B requests with the same short prompt (``PROMPT``) prefilled, then ``--steps``
decode steps timed. Rounds alternate free and constrained (schema ``SCHEMA``: an array of at least 200
integers, so the grammar cannot end within the steps and both kinds decode every step), and
each kind's time is the median of its rounds, so load that drifts during the run falls on
both alike. The ratio constrained / free is the overhead.

Libraries (``--libraries``, the default): xgrammar, llguidance and outlines-core, each with
the default model's tokenizer (49,152 tokens) and one JSON schema (``PERSON``): setup (the
vocabulary), compile, and per token the mask fill alone, then fill + apply to a logits row +
advance, over a valid answer's tokens, best of 5 passes. A library that is not installed is
skipped.

ITL under new schemas (``--itl``): the default model on an engine thread, as a worker runs it
(``EngineThread``, one torch thread), ``--streams`` free greedy streams decoding, and
``--arrivals`` constrained requests arriving ``--interval`` s apart while they do. Rounds
alternate two kinds: ``same`` (every request has one schema, compiled before the round) and
``fresh`` (every request has a schema never seen before, ``fresh_schema``: a grammar to
compile per request, ``--schema-props`` large). The free streams' inter-token latency is measured from the first arrival
until the last constrained request ends, pooled over each kind's rounds. A new grammar per
request must not raise their ITL p99 by more than 20% (issue 41): ``fresh`` p99 / ``same`` p99
at most 1.2. Grammars compile on a thread of their own (pdserve/engine/sampling/grammar_jobs.py); on the
engine thread, each compile stalled every stream. Writes JSON to .bench/structured.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.engine_thread import EngineThread  # noqa: E402
from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling.params import SamplingParams  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
          "address": {"city": "London", "zip": "W1"}}
PROMPT = "List two hundred numbers between 0 and 999 as a JSON array: ["


def decode_ms(engine: LLMEngine, batch: int, steps: int, structured: StructuredOutput | None, tag: str) -> float:
    """ms per decode step of ``batch`` requests (all constrained, or none)."""
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, structured=structured)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode step (matchers catch up with the first token)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps * 1e3


def bench_tpot(batches: list[int], steps: int, rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    engine = LLMEngine.from_config(EngineConfig(
        dtype="bfloat16", cache=CacheConfig(memory_budget_bytes=1 << 30, enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_num_seqs=max(batches))), progress=False)
    schema = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    decode_ms(engine, 1, 4, schema, "warm-c")  # builds the grammar compiler, compiles the schema
    decode_ms(engine, 1, 4, None, "warm-f")
    rows = []
    for b in batches:
        free, constrained = [], []
        for r in range(rounds):
            free.append(decode_ms(engine, b, steps, None, f"f{b}-{r}"))
            constrained.append(decode_ms(engine, b, steps, schema, f"c{b}-{r}"))
        f, c = statistics.median(free), statistics.median(constrained)
        rows.append({"batch": b, "free_ms": f, "schema_ms": c, "ratio": c / f, "free_rounds": free,
                     "schema_rounds": constrained})
        print(f"batch {b:2d}: TPOT free {f:7.2f} ms, JSON schema {c:7.2f} ms, ratio {c / f:.3f} "
              f"(rounds free {' '.join(f'{x:.1f}' for x in free)}; schema {' '.join(f'{x:.1f}' for x in constrained)})",
              flush=True)
    return rows


def fresh_schema(n: int, props: int = 80) -> StructuredOutput:
    """A schema no request had before (property names carry ``n``): ``props`` arrays of small
    objects, like a large tool's parameters. 80 took 0.1-0.2 s to compile on a 2-core EPYC."""
    item = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"},
                                             "c": {"type": "array", "items": {"type": "number"}}}}
    fields = {f"f{n}_{k}": {"type": "array", "items": item} for k in range(props)}
    return StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": fields,
                                                                 "required": [f"f{n}_0"]}))


class _Stamps:
    """When each request's outputs came (``on_outputs`` of the engine thread)."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, outputs) -> None:
        now = time.perf_counter()
        with self.lock:
            for o in outputs:
                self.times.setdefault(o.request_id, []).append(now)
                if o.finished:
                    self.finished.add(o.request_id)


def itl_round(engine: LLMEngine, kind: str, tag: str, streams: int, arrivals: int, interval_s: float,
              schemas) -> list[float]:
    """The free streams' inter-token gaps (ms) while ``arrivals`` constrained requests come."""
    stamps = _Stamps()
    thread = EngineThread(engine, stamps, name="bench-engine")
    thread.start()
    prompt = engine.tokenizer.encode(PROMPT)
    free = [f"{tag}-free-{i}" for i in range(streams)]
    endless = SamplingParams(max_tokens=engine.max_model_len - len(prompt) - 1, ignore_eos=True)
    try:
        for rid in free:
            thread.call(engine.add_request, rid, prompt, endless).result()
        while len(stamps.times) < streams:
            time.sleep(0.01)
        start = time.perf_counter()
        constrained = [f"{tag}-{kind}-{i}" for i in range(arrivals)]
        added = []  # not waited for: before issue 41, adding one compiled its grammar on the engine thread
        for i, rid in enumerate(constrained):
            added.append(thread.call(engine.add_request, rid, prompt, SamplingParams(max_tokens=16,
                                                                                     structured=schemas(i))))
            time.sleep(interval_s)
        for future in added:
            future.result()
        while not set(constrained) <= stamps.finished:
            time.sleep(0.01)
        end = time.perf_counter()
        for rid in free:
            thread.call(engine.abort, rid).result()
    finally:
        thread.stop()
    gaps = []
    for rid in free:
        t = stamps.times[rid]
        gaps += [(b - a) * 1e3 for a, b in zip(t, t[1:]) if start <= b <= end]
    return gaps


def bench_itl(streams: int, arrivals: int, interval_s: float, rounds: int, props: int) -> dict:
    torch.set_num_threads(1)
    engine = LLMEngine.from_config(EngineConfig(
        dtype="bfloat16", cache=CacheConfig(memory_budget_bytes=1 << 30, enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_num_seqs=streams + arrivals, policy="mixed")), progress=False)
    same = fresh_schema(-1, props)
    engine.generate([engine.tokenizer.encode(PROMPT)], SamplingParams(max_tokens=2, structured=same))  # compiled
    counter = iter(range(1_000_000))
    gaps: dict[str, list[float]] = {"same": [], "fresh": []}
    for r in range(rounds):
        for kind in ("same", "fresh"):
            schemas = (lambda i: same) if kind == "same" else (lambda i: fresh_schema(next(counter), props))
            gaps[kind] += itl_round(engine, kind, f"r{r}", streams, arrivals, interval_s, schemas)
    result = {kind: {"p50_ms": _pct(g, 0.5), "p99_ms": _pct(g, 0.99), "gaps": len(g)} for kind, g in gaps.items()}
    result["p99_ratio"] = result["fresh"]["p99_ms"] / result["same"]["p99_ms"]
    for kind in ("same", "fresh"):
        print(f"ITL of {streams} free streams, {kind:5s} schemas: p50 {result[kind]['p50_ms']:7.2f} ms, "
              f"p99 {result[kind]['p99_ms']:7.2f} ms ({result[kind]['gaps']} gaps)", flush=True)
    verdict = "within" if result["p99_ratio"] <= 1.2 else "OVER"
    print(f"p99 fresh / same: {result['p99_ratio']:.3f} ({verdict} the 1.2 bound)", flush=True)
    return result


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _timed(ids, fill, apply_advance, passes: int = 5) -> tuple[float, float]:
    """(mean fill us, best-pass fill + apply + advance us) per token over ``ids``."""
    fill_total, best = 0.0, float("inf")
    for _ in range(passes):
        state = apply_advance(None)
        t0 = time.perf_counter()
        for token in ids:
            t = time.perf_counter()
            fill(state)
            fill_total += time.perf_counter() - t
            apply_advance((state, token))
        best = min(best, (time.perf_counter() - t0) / len(ids))
    return fill_total / passes / len(ids) * 1e6, best * 1e6


def bench_libraries(hf_tok, vocab: int) -> list[dict]:
    torch.set_num_threads(1)
    ids = hf_tok.encode(json.dumps(ANSWER), add_special_tokens=False) + [hf_tok.eos_token_id]
    logits = torch.randn(1, vocab)
    out = []
    for name, run in (("xgrammar", _xgrammar), ("llguidance", _llguidance), ("outlines-core", _outlines)):
        try:
            row = run(hf_tok, vocab, ids, logits)
        except ImportError:
            print(f"{name}: not installed, skipped")
            continue
        out.append({"library": name, **row})
        print(f"{name} {row['version']}: vocabulary setup {row['setup_ms']:.0f} ms, compile {row['compile_ms']:.1f} ms, "
              f"fill {row['fill_us']:.0f} us/token, fill + apply + advance {row['token_us']:.0f} us/token", flush=True)
    return out


def _xgrammar(hf_tok, vocab, ids, logits) -> dict:
    import importlib.metadata

    import xgrammar as xgr

    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab), max_threads=1,
                                   cache_enabled=False)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=False)
    comp = time.perf_counter() - t
    mask = xgr.allocate_token_bitmask(1, vocab)

    def step(arg):
        if arg is None:
            return xgr.GrammarMatcher(compiled)
        matcher, token = arg
        row = logits.clone()
        xgr.apply_token_bitmask_inplace(row, mask)
        assert torch.isfinite(row[0, token]) and matcher.accept_token(token)

    fill, per = _timed(ids, lambda m: m.fill_next_token_bitmask(mask), step)
    return {"version": importlib.metadata.version("xgrammar"), "setup_ms": setup * 1e3, "compile_ms": comp * 1e3,
            "fill_us": fill, "token_us": per}


def _llguidance(hf_tok, vocab, ids, logits) -> dict:
    import importlib.metadata

    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf_tok, vocab)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PERSON))
    llguidance.LLMatcher(lltok, grammar)
    comp = time.perf_counter() - t
    mask = lt.allocate_token_bitmask(1, vocab)

    def step(arg):
        if arg is None:
            return llguidance.LLMatcher(lltok, grammar)
        matcher, token = arg
        row = logits.clone()
        lt.apply_token_bitmask_inplace(row, mask)
        assert torch.isfinite(row[0, token]) and matcher.consume_token(token)

    fill, per = _timed(ids, lambda m: lt.fill_next_token_bitmask(m, mask, 0), step)
    return {"version": importlib.metadata.version("llguidance"), "setup_ms": setup * 1e3, "compile_ms": comp * 1e3,
            "fill_us": fill, "token_us": per}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE vocabulary
    shows -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _outlines(hf_tok, vocab, ids, logits) -> dict:
    import importlib.metadata

    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t = time.perf_counter()
    dec, special, by_bytes = _byte_decoder(), set(hf_tok.all_special_ids), {}
    for text, tid in hf_tok.get_vocab().items():
        if tid not in special and tid < vocab:
            by_bytes.setdefault(bytes(dec[ch] for ch in text), []).append(tid)
    vocabulary = Vocabulary(hf_tok.eos_token_id, by_bytes)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(PERSON)), vocabulary)
    comp = time.perf_counter() - t
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)

    def fill(guide):
        mask.zero_()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    def step(arg):
        if arg is None:
            return Guide(index)
        guide, token = arg
        allowed = ((mask.unsqueeze(-1) >> bits) & 1).view(1, -1)[:, :vocab].bool()
        row = logits.clone().masked_fill_(~allowed, float("-inf"))
        assert torch.isfinite(row[0, token])
        if token != hf_tok.eos_token_id:
            guide.advance(token)

    fill_us, per = _timed(ids, fill, step)
    return {"version": importlib.metadata.version("outlines-core"), "setup_ms": setup * 1e3, "compile_ms": comp * 1e3,
            "fill_us": fill_us, "token_us": per}


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-libraries", dest="libraries", action="store_false")
    ap.add_argument("--no-tpot", dest="tpot", action="store_false")
    ap.add_argument("--itl", action="store_true", help="ITL of free streams while requests with new schemas arrive")
    ap.add_argument("--streams", type=int, default=8, help="--itl: free streams decoding")
    ap.add_argument("--arrivals", type=int, default=16, help="--itl: constrained requests per round")
    ap.add_argument("--interval", type=float, default=0.25, help="--itl: seconds between arrivals")
    ap.add_argument("--schema-props", type=int, default=80, help="--itl: properties of each schema (its compile cost)")
    args = ap.parse_args()
    import os

    result = {"load_before": os.getloadavg()}
    if args.libraries:
        from pdserve.engine.loader import materialize
        from pdserve.engine.tokenizer import Tokenizer

        result["libraries"] = bench_libraries(Tokenizer(materialize("default", progress=False)).hf, 49152)
    if args.tpot:
        result["tpot"] = bench_tpot(args.batches, args.steps, args.rounds)
    if args.itl:
        result["itl"] = bench_itl(args.streams, args.arrivals, args.interval, args.rounds, args.schema_props)
    result["load_after"] = os.getloadavg()
    print(f"load average before {result['load_before'][0]:.2f}, after {result['load_after'][0]:.2f}")
    out = ROOT / ".bench" / "structured.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

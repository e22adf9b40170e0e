"""Structured output: a grammar that decides which tokens a request may draw next.

A request's ``SamplingParams.structured`` names a JSON schema, "any JSON object" or a regular
expression. The engine compiles it once per distinct spec against the model's vocabulary
(``GrammarCompiler``), off its own thread (``pdserve.engine.sampling.grammar_jobs``: a new spec must
not stall the streams batched with it), and the sampler keeps one ``GrammarMatcher`` per
constrained sequence: before each draw it advances the matcher over the sequence's output
tokens it has not seen yet, then masks every token the grammar forbids. Once the grammar is complete only
the stop tokens stay allowed, so the output ends with EOS.

Because the matcher catches up from the sequence's own tokens, every place a request runs
agrees on where it is: the prefill worker's first token, the decode worker's steps (its
matcher starts by accepting that first token), a preempted sequence recomputed, and a
migrated request whose prompt holds its earlier output (``StructuredOutput.resumed_tokens``).

The library is xgrammar, the fastest of the three made for this on this CPU, with the
default model's 49,152-token vocabulary and one JSON schema, one thread (``benchmarks/
structured.py``; per-token mask fill / fill + apply + advance): xgrammar 0.2.8 11 / 216 us,
llguidance 1.9.1 77 / 311 us, outlines-core 0.2.14 51 / 596 us (and 266 ms to compile the
schema, against 12 and 3).
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from pdserve.engine.device import to_device
from pdserve.engine.errors import InvalidRequestError

if TYPE_CHECKING:  # the router imports this module and needs neither
    import torch
    import xgrammar


COMPILE_CACHE_BYTES = 64 << 20
# Bounds on what a request may ask to compile. xgrammar's time grows steeply with nesting
# (measured, one thread: a schema of objects nested 64 deep, 128 JSON levels, takes 0.09 s to
# convert; 128 deep 0.9 s; 300 deep 9 s), and the router converts every spec it is sent.
MAX_SPEC_CHARS = 65_536
MAX_SCHEMA_DEPTH = 128  # JSON nesting levels of a schema
# Specs whose conversion (accepted or refused) the router remembers: at most MAX_SPEC_CHARS
# each, so at most 16 MiB of keys.
CONVERSION_CACHE_SPECS = 256


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec unused
    REGEX = "regex"  # spec: a regular expression the whole output matches


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must look like. ``resumed_tokens``: the prompt's last this many tokens
    are output that was already generated under this grammar (the router re-sends a migrated
    request's output as prompt); the matcher accepts them before the first draw."""

    kind: GrammarKind
    spec: str = ""
    resumed_tokens: int = 0

    def check(self, field: str = "structured_output") -> None:
        """The cheap part of ``validate`` (sizes), which every engine runs on entry."""
        if self.resumed_tokens < 0:
            raise InvalidRequestError(f"{field}.resumed_tokens", f"must be >= 0, got {self.resumed_tokens}", 0)
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(field, f"{len(self.spec)} characters; the limit is {MAX_SPEC_CHARS}",
                                      MAX_SPEC_CHARS)

    def validate(self, field: str = "structured_output") -> None:
        """Raise ``InvalidRequestError`` naming ``field`` if the spec cannot be compiled. Needs
        no tokenizer, so the router checks a request before routing it. Each spec converts
        once (``_conversion``), off the router's event loop (its callers run on the
        tokenizer threads: ``pdserve.router.frontend.prepare``, ``pdserve.router.validation``)."""
        self.check(field)
        refusal = _conversion(self.kind, self.spec)
        if refusal is not None:
            raise InvalidRequestError(field, refusal.reason, refusal.limit)


def resumed(so: StructuredOutput | None, generated: int) -> StructuredOutput | None:
    """``so`` for a request re-sent with ``generated`` output tokens appended to its prompt."""
    return None if so is None else replace(so, resumed_tokens=so.resumed_tokens + generated)


class GrammarViolation(RuntimeError):
    """A sequence holds a token its grammar forbids (a worker sent output it did not sample
    under the same grammar): the step fails and the request is aborted."""


_FIELD = "structured_output"  # the field _conversion's errors name, replaced by the caller's


@dataclass(frozen=True)
class _Refusal:
    """Why a spec does not convert, for any field name (``InvalidRequestError``'s message)."""

    reason: str
    limit: object = None


@functools.lru_cache(maxsize=CONVERSION_CACHE_SPECS)
def _conversion(kind: GrammarKind, spec: str) -> _Refusal | None:
    """Converts a spec once and remembers the outcome, refusals as well: a request checked
    twice on its way in (the HTTP front names the body's parameter, ``pdserve.router.tools``,
    then ``prepare`` checks the wire request) converts once, and a client resending a spec
    that cannot convert (up to 0.9 s each at the depth limit) costs a lookup. xgrammar
    releases the GIL while it converts, so threads doing this leave the event loop free."""
    try:
        _grammar(StructuredOutput(kind, spec), _FIELD)
    except InvalidRequestError as exc:
        return _Refusal(str(exc).removeprefix(f"{_FIELD}: "), exc.limit)
    return None


def _grammar(so: StructuredOutput, field: str) -> "xgrammar.Grammar":
    import xgrammar as xgr

    try:
        if so.kind is GrammarKind.JSON_SCHEMA:
            schema = json.loads(so.spec)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object or a boolean")
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(field, f"nests deeper than {MAX_SCHEMA_DEPTH} levels", MAX_SCHEMA_DEPTH)
            return xgr.Grammar.from_json_schema(so.spec, any_whitespace=False)
        if so.kind is GrammarKind.REGEX:
            return xgr.Grammar.from_regex(so.spec)
        return xgr.Grammar.builtin_json_grammar()
    except InvalidRequestError:
        raise
    except (ValueError, RuntimeError) as exc:  # json.JSONDecodeError is a ValueError
        # xgrammar prefixes its messages with a timestamp and a source location.
        reason = str(exc).splitlines()[0].split(": ", 1)[-1] if "] /" in str(exc) else str(exc).splitlines()[0]
        raise InvalidRequestError(field, f"cannot use this {so.kind.value}: {reason}") from None


def _depth(value) -> int:
    """JSON nesting depth (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in children)
    return deepest


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary; compiled grammars are cached by spec.

    ``hf_tokenizer`` is the ``transformers`` tokenizer (its byte-level vocabulary is what the
    grammar matches), ``vocab_size`` the model's logits width (it may exceed the tokenizer's),
    ``stop_token_ids`` the ids that end a sequence (allowed once the grammar is complete).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        # xgrammar caches compiled grammars by spec; the bound keeps a stream of distinct
        # schemas from growing a worker without limit.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILE_CACHE_BYTES)

    def compile(self, so: StructuredOutput, field: str = "structured_output") -> "xgrammar.CompiledGrammar":
        """Raises ``InvalidRequestError`` naming ``field`` for a spec that does not compile."""
        _grammar(so, field)  # the spec's own errors, worded for the client
        try:
            if so.kind is GrammarKind.JSON_SCHEMA:
                return self._compiler.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind is GrammarKind.REGEX:
                return self._compiler.compile_regex(so.spec)
            return self._compiler.compile_builtin_json_grammar()
        except RuntimeError as exc:
            raise InvalidRequestError(field, f"cannot compile this {so.kind.value}: {exc}") from None

    def matcher(self, so: StructuredOutput) -> "GrammarMatcher":
        return GrammarMatcher(self.compile(so), so.resumed_tokens)


class GrammarMatcher:
    """One sequence's place in its grammar. ``advance`` catches up with the sequence's
    tokens, ``fill`` writes what the grammar allows next into a bitmask (``apply_bitmask``),
    and once it is ``finished`` only stop tokens may follow (``allow_only``)."""

    def __init__(self, compiled: "xgrammar.CompiledGrammar", resumed_tokens: int):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.resumed_tokens = resumed_tokens
        self.consumed = 0  # tokens of the grammar's output accepted so far

    def advance(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Accept the output tokens (``token_ids[num_prompt_tokens - resumed_tokens:]``) not
        seen yet. Raises ``GrammarViolation`` for a token the grammar forbids."""
        start = num_prompt_tokens - self.resumed_tokens + self.consumed
        for token in token_ids[start:]:
            # After the grammar's end only stop tokens can be drawn (ignore_eos goes on
            # drawing them); there is nothing left to match.
            if not self._matcher.is_terminated() and not self._matcher.accept_token(token):
                raise GrammarViolation(f"token {token} at output position {self.consumed} breaks the grammar")
            self.consumed += 1

    @property
    def finished(self) -> bool:
        """The grammar is complete: only stop tokens may follow (``allow_only``)."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write what the grammar allows next into host ``bitmask[row]`` (1 bit a token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def token_bitmask(batch: int, vocab: int) -> "torch.Tensor":
    """A host bitmask for one step: (batch, ceil(vocab / 32)) int32, every token allowed.
    Matchers fill their own rows (``GrammarMatcher.fill``); ``apply_bitmask`` applies them."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(batch, vocab)


def allow_only(bitmask: "torch.Tensor", row: int, token_ids: Sequence[int]) -> None:
    """Host ``bitmask[row]``: ``token_ids`` allowed, every other token forbidden (a finished
    grammar's row: its stop tokens only)."""
    import torch

    words = [0] * bitmask.shape[1]
    for t in token_ids:
        words[t >> 5] |= 1 << (t & 31)
    bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def apply_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor", rows: Sequence[int]) -> None:
    """logits (B, V) float32, in place: -inf where ``bitmask`` forbids a token, in ``rows``
    only (the others keep their bits). xgrammar fills bitmasks on the host and applies them
    only on the logits' device, so the step's mask and its rows go there in one copy that the
    host does not wait for (a Python list of rows would be copied, and waited for, by xgrammar)."""
    import torch
    import xgrammar as xgr

    bitmask, indices = to_device([bitmask, torch.tensor(rows, dtype=torch.int32)], logits.device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)

"""Structured-output grammars compiled off the engine thread.

Compiling the grammar of a spec not seen before takes from milliseconds to seconds (xgrammar,
against a 49k-token vocabulary), and building the compiler the first time 1-2 s. On the engine
thread that time would be taken from every stream in the batch: a new schema per request
would stall all of them. So a request with a spec waits here, outside the scheduler, while one
compile thread works, and the engine takes the finished jobs at the start of a step (``done``)
without waiting for any.

A job not finished ``deadline_s`` after its request arrived fails that request
(``InvalidRequestError`` naming the field and the limit); the thread cannot be stopped in a
compile, so it finishes and its grammar is dropped. A job still queued at its deadline is not
started. The thread runs ``NICE`` steps below the engine's priority: on a busy worker it takes
the time the engine leaves, not the engine's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.grammar import GrammarCompiler, StructuredOutput

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

FIELD = "structured_output"
# The longest a request waits for its grammar. The router refuses specs over 64 KiB and nested
# past 128 levels (engine.grammar), which convert in under a second; the rest covers a queue of
# them on a loaded worker, whose compile thread runs at a lower priority.
COMPILE_DEADLINE_S = 10.0
NICE = 10


@dataclass(frozen=True)
class _Job:
    spec: StructuredOutput
    deadline: float  # time.monotonic()
    future: Future


def compiler_for(tokenizer, model_dir: str | None, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> Callable[[], GrammarCompiler]:
    """What builds an engine's grammar compiler, on the compile thread, for its first structured
    request (1-2 s with a 49k vocabulary: xgrammar's import and its vocabulary tables). An engine
    that does not detokenize (``tokenizer`` None) loads its tokenizer from ``model_dir`` then."""
    def make() -> GrammarCompiler:
        tok = tokenizer
        if tok is None and model_dir is not None:
            from pdserve.engine.tokenizer import Tokenizer

            tok = Tokenizer(model_dir)
        if tok is None:
            raise InvalidRequestError("structured_output", "this engine has no tokenizer to compile grammars with")
        return GrammarCompiler(tok.hf, vocab_size, sorted(eos_token_ids))
    return make


class GrammarJobs:
    """The compile jobs of one engine, by request id. ``make_compiler`` builds the compiler on
    the compile thread when the first job runs; ``notify`` is called (on that thread) whenever
    a job finishes, so an idle engine thread wakes for it."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], deadline_s: float = COMPILE_DEADLINE_S,
                 notify: Callable[[], None] | None = None):
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self.deadline_s = deadline_s
        self.notify = notify
        self._jobs: dict[str, _Job] = {}
        self._pool: ThreadPoolExecutor | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, request_id: str, spec: StructuredOutput) -> None:
        """Start compiling ``spec`` for ``request_id`` (a job of that id must not be pending)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar", initializer=_lower_priority)
        deadline = time.monotonic() + self.deadline_s
        future = self._pool.submit(self._compile, spec, deadline)
        self._jobs[request_id] = _Job(spec, deadline, future)
        future.add_done_callback(self._finished)

    def cancel(self, request_id: str) -> None:
        """Forget ``request_id``'s job (its request ended); a compile under way finishes unseen."""
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.future.cancel()

    def done(self) -> list[tuple[str, "xgrammar.CompiledGrammar | InvalidRequestError"]]:
        """The jobs that finished or passed their deadline, taken out: each request's grammar,
        or the error that ends it. Never waits."""
        now = time.monotonic()
        results = []
        for request_id, job in list(self._jobs.items()):
            if job.future.done() and not job.future.cancelled():
                error = job.future.exception()
                results.append((request_id, job.future.result() if error is None else _as_invalid(error)))
            elif now >= job.deadline:
                job.future.cancel()
                results.append((request_id, _late(self.deadline_s)))
            else:
                continue
            del self._jobs[request_id]
        return results

    def has_done(self) -> bool:
        """Whether ``done`` would return something. Safe from any thread (a worker's Stats
        reads it through ``LLMEngine.has_runnable`` off the engine thread)."""
        now = time.monotonic()
        return any(job.future.done() or now >= job.deadline for job in list(self._jobs.values()))

    def next_deadline_s(self) -> float | None:
        """Seconds until the earliest pending job's deadline (None: no job pending)."""
        if not self._jobs:
            return None
        return max(0.0, min(job.deadline for job in self._jobs.values()) - time.monotonic())

    def wait(self) -> None:
        """Block until a job finishes or a deadline passes (for an engine with nothing else to run)."""
        timeout = self.next_deadline_s()
        if timeout is not None:
            concurrent.futures.wait([job.future for job in self._jobs.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the compile thread once its compile under way ends (a later ``submit`` starts
        another); jobs not started are cancelled, and fail at their deadline."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ---- the compile thread -----------------------------------------------------------
    def _compile(self, spec: StructuredOutput, deadline: float) -> "xgrammar.CompiledGrammar":
        if time.monotonic() >= deadline:  # queued behind slower jobs until too late: skip it
            raise _late(self.deadline_s)
        if self._compiler is None:  # only this thread builds it (one worker)
            self._compiler = self._make_compiler()
        return self._compiler.compile(spec, FIELD)

    def _finished(self, future: Future) -> None:
        if self.notify is not None and not future.cancelled():
            self.notify()


def _late(deadline_s: float) -> InvalidRequestError:
    return InvalidRequestError(FIELD, f"its grammar did not compile within {deadline_s:g} s (the limit)", deadline_s)


def _as_invalid(error: BaseException) -> InvalidRequestError:
    """A compile's error as the request's: the compiler's own errors already name the field."""
    if isinstance(error, InvalidRequestError):
        return error
    return InvalidRequestError(FIELD, f"cannot compile this spec: {type(error).__name__}: {error}")


def _lower_priority() -> None:
    """Run the compile thread ``NICE`` steps below the engine (Linux: priority is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError) as exc:  # another OS, or not allowed: the thread runs as is
        log.debug("grammar compile thread keeps its priority: %s", exc)

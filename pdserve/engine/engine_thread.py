"""Runs an ``LLMEngine`` on a thread of its own.

The engine is single-threaded by design; a worker's RPC handlers run elsewhere (an asyncio
loop). They reach the engine only through ``call``, which queues a function to run on the
engine thread between steps and returns a future. Each loop iteration runs, in this order:
the queued calls, the ``hooks``, then one step. So a request added while step N runs is in
step N+1. Outputs go to ``on_outputs`` once per step; a step that raises ``StepFailed`` goes
to ``on_step_error`` (its requests are already aborted; the loop carries on). A step that
raises anything else came to grief outside the runner's isolation (the scheduler, the
bookkeeping after a step): nothing pins it on a sequence, and the same state would raise again
at every later step, so the requests it could have run are aborted and reported the same way
(``StepFailed``), and each ends; before, they waited forever while the loop logged the error.

A ``hold`` may delay a step a little for work about to arrive: it returns a moment
(``time.monotonic``) to wait until, or None. Until then the loop runs calls and hooks as they
come, and steps as soon as every hold is past or returns None. A decode worker holds for a
stream whose KV is on its way, so the stream joins this step, not the next.

Waits are event-driven. Each hook returns how soon it needs to run again (seconds), or None
when nothing it watches can change until a call arrives. An idle engine blocks on its call
queue for the smallest of those, forever when every hook says None: an idle worker uses no
CPU. A worker's hooks poll KV transfers and leases there, so nothing that touches the engine
or the KV cache ever runs concurrently with a forward pass. The engine's grammar compiles
(``pdserve.engine.sampling.grammar_jobs``) run on a thread of their own: one that finishes wakes the
loop, and the loop wakes by itself at the earliest compile deadline.

With a ``step_trace``, every step's start, length and shape go to it (``pdserve.engine.core.step_trace``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional

from pdserve.engine.errors import RankLost, StepFailed
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.core.step_trace import StepTrace

log = logging.getLogger(__name__)

Hook = Callable[[], Optional[float]]  # runs on the engine thread; returns seconds until it needs to run again
Hold = Callable[[], Optional[float]]  # runs on the engine thread; returns a time.monotonic() to hold the step until
HOLD_POLL_S = 0.0005  # while a step is held, the hooks run at most this often
HOLD_IDLE_POLL_S = 0.005  # and at least this often (a paced decode step sleeps in such slices)

_WAKE = object()  # queued by ``stop`` so a blocked loop sees the stop flag


class EngineThread:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 hooks: Iterable[Hook] = (), name: str = "engine", holds: Iterable[Hold] = (),
                 on_step_error: Callable[[StepFailed], None] | None = None, step_trace: StepTrace | None = None):
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_step_error = on_step_error
        self._hooks = list(hooks)
        self._holds = list(holds)
        self._calls: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        self.last_step_s = 0.0  # how long the last step that ran took (a hook may size a wait by it)
        self.last_step_started = 0.0  # when it started, time.monotonic() (a hold may pace steps by it)
        self.idle_waits = 0  # times the loop blocked with nothing to run (tests read it)
        self._trace = step_trace  # every step's start, length and shape (engine.core.step_trace)
        self._idle_since_step = True
        engine.keep_step_shape = step_trace is not None
        engine.grammars.notify = self._wake  # a compiled grammar lets its request join the next step

    def start(self) -> None:
        self._thread.start()

    def add(self, hook: Hook | None = None, hold: Hold | None = None) -> None:
        """One more hook or hold, before ``start``."""
        self._hooks += [hook] if hook is not None else []
        self._holds += [hold] if hold is not None else []

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout)
        self.engine.grammars.close()
        if self._trace is not None:
            self._trace.close()

    @property
    def alive(self) -> bool:
        """Whether the loop still runs (``stop`` waits for it only so long)."""
        return self._thread.is_alive()

    def _wake(self) -> None:
        """Make a loop blocked on its call queue go round once (from any thread)."""
        self._calls.put(_WAKE)

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the engine thread before the next step; its result or
        exception lands in the returned future."""
        fut: Future = Future()
        self._calls.put((fn, args, fut))
        return fut

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_calls()
                wait_s = self._run_hooks()
                if self.engine.has_runnable():
                    self._hold()
                    self._step()
                else:
                    self._wait_for_call(wait_s)
            except Exception:  # a bug here must not silently kill the worker's engine
                log.exception("engine loop iteration failed")

    def _run_hooks(self) -> float | None:
        """Run every hook; the soonest any of them (or a grammar deadline) wants the loop to
        run again (None: not before a call)."""
        soonest = self.engine.grammars.next_deadline_s()
        for hook in self._hooks:
            wait_s = hook()
            if wait_s is not None:
                soonest = wait_s if soonest is None else min(soonest, wait_s)
        return soonest

    def _hold(self) -> None:
        """Before a step: until the latest moment a hold names, run calls and hooks as they come:
        each hook as soon as it asked to run again, and at least every ``HOLD_IDLE_POLL_S`` (a call
        wakes the loop at once)."""
        poll_s = HOLD_POLL_S
        while self._holds and not self._stop.is_set():
            until = max((t for t in (hold() for hold in self._holds) if t is not None), default=None)
            left = until - time.monotonic() if until is not None else 0.0
            if left <= 0:
                return
            try:
                self._run_call(self._calls.get(timeout=min(left, poll_s)))
                self._drain_calls()
            except queue.Empty:
                pass
            soonest = self._run_hooks()
            poll_s = HOLD_IDLE_POLL_S if soonest is None else min(max(soonest, HOLD_POLL_S), HOLD_IDLE_POLL_S)

    def _step(self) -> None:
        start, t = time.time(), time.perf_counter()
        cpu = time.thread_time() if self._trace is not None else 0.0  # only a trace reads it
        self.last_step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except StepFailed as exc:
            log.error("%s", exc, exc_info=exc.cause)
            if self._on_step_error is not None:
                self._on_step_error(exc)
            self._idle_since_step = True  # a gap in the trace: the next step's time is its own
            return
        except RankLost:
            raise  # the worker is lost as a whole (its ``on_rank_lost`` ends it)
        except Exception as exc:  # outside the runner: no row to pin it on (module docstring)
            self._step_broke(exc)
            return
        self.steps += 1
        self.last_step_s = time.perf_counter() - t
        if self._trace is not None and self.engine.last_step_shape is not None:
            self._trace.write(start, time.perf_counter() - t, self._idle_since_step, self.engine.last_step_shape,
                              time.thread_time() - cpu)
        self._idle_since_step = False
        if outputs:
            self._on_outputs(outputs)

    def _step_broke(self, exc: Exception) -> None:
        """Abort every request the broken step could have run (queued or running; not those
        waiting for KV, whose reads the transport ends) and report them as one ``StepFailed``."""
        scheduler = self.engine.scheduler
        ids = list(dict.fromkeys(seq.seq_id for seq in [*scheduler.waiting, *scheduler.running]))
        for request_id in ids:
            try:
                self.engine.abort(request_id)
            except Exception:  # a half-updated scheduler: the request is reported ended all the same
                log.exception("aborting %s after a failed step", request_id)
        failed = StepFailed(ids, exc)
        log.error("%s", failed, exc_info=exc)
        self._idle_since_step = True
        if self._on_step_error is not None:
            self._on_step_error(failed)

    def _drain_calls(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            self._run_call(item)

    def _wait_for_call(self, timeout_s: float | None) -> None:
        if self._stop.is_set():  # stop()'s wake-up may have been drained with the calls already
            return
        self.idle_waits += 1
        self._idle_since_step = True
        try:
            item = self._calls.get(timeout=max(timeout_s, 0.0) if timeout_s is not None else None)
        except queue.Empty:
            return
        self._run_call(item)

    @staticmethod
    def _run_call(item) -> None:
        if item is _WAKE:
            return
        fn, args, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller, who decides
            fut.set_exception(exc)

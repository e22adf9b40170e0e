"""Runs an ``LLMEngine`` on a thread of its own.

The engine is single-threaded by design; a worker's RPC handlers run elsewhere (an asyncio
loop). They reach the engine only through ``call``, which queues a function to run on the
engine thread between steps and returns a future. Outputs go to ``on_outputs``, called on
the engine thread after every step. ``hooks`` run once per loop iteration on the same
thread (a worker polls its KV transfers and leases there), so nothing that touches the
engine or the KV cache ever runs concurrently with a forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 hooks: Iterable[Callable[[], None]] = (), idle_wait_s: float = 0.002, name: str = "engine"):
        self.engine = engine
        self._on_outputs = on_outputs
        self._hooks = list(hooks)
        self._idle_wait_s = idle_wait_s  # how long an idle loop sleeps waiting for work
        self._calls: queue.Queue[tuple[Callable[..., Any], tuple, Future]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

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
                for hook in self._hooks:
                    hook()
                if self.engine.has_runnable():
                    outputs = self.engine.step()
                    self.steps += 1
                    if outputs:
                        self._on_outputs(outputs)
                else:
                    self._wait_for_call()
            except Exception:  # a bug here must not silently kill the worker's engine
                log.exception("engine loop iteration failed")

    def _drain_calls(self) -> None:
        while True:
            try:
                fn, args, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            self._run_call(fn, args, fut)

    def _wait_for_call(self) -> None:
        try:
            fn, args, fut = self._calls.get(timeout=self._idle_wait_s)
        except queue.Empty:
            return
        self._run_call(fn, args, fut)

    @staticmethod
    def _run_call(fn, args, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller, who decides
            fut.set_exception(exc)

"""A steady load for the fault and rollout tests: client threads sending greedy chat requests
round-robin over a set of prompts until stopped, every request's outcome recorded."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc

from tests.helpers.chat import chat_request


@dataclass
class Outcome:
    prompt: int  # index into the load's prompts
    tokens: list[int]  # a failed request's: those it was sent before it failed
    code: grpc.StatusCode | None  # None: completed
    details: str
    started: float
    ended: float


class Load:
    """``clients`` threads over one stub; a client that got an error waits ``pause_after_error_s``
    before its next request, as a real client would."""

    def __init__(self, stub, prompts: list[str], max_tokens: int, clients: int, timeout_s: float,
                 pause_after_error_s: float = 0.0):
        self.stub, self.prompts, self.max_tokens, self.clients = stub, prompts, max_tokens, clients
        self.timeout_s, self.pause_after_error_s = timeout_s, pause_after_error_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]

    def __enter__(self):
        self.started, self.started_at = time.monotonic(), time.time()  # the latter for the pods' logs
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)

    def _client(self, k: int) -> None:
        n = k
        while not self._stop.is_set():
            prompt, n = n % len(self.prompts), n + self.clients
            start = time.monotonic()
            request = chat_request(self.prompts[prompt], self.max_tokens, ignore_eos=True)
            ids: list[int] = []
            try:
                for response in self.stub.Generate(request, timeout=self.timeout_s):
                    ids += response.token_ids
                self.outcomes.append(Outcome(prompt, ids, None, "", start, time.monotonic()))
            except grpc.RpcError as exc:  # the tokens it had sent stay: did the stream start?
                self.outcomes.append(Outcome(prompt, ids, exc.code(), exc.details(), start, time.monotonic()))
                time.sleep(self.pause_after_error_s)

    def wait_for(self, more: int, timeout_s: float = 60.0) -> None:
        """Until ``more`` further requests have ended."""
        target = len(self.outcomes) + more
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < target:
            assert time.monotonic() < deadline, f"the load stalled at {len(self.outcomes)} requests"
            time.sleep(0.05)

    def spanning(self, t: float) -> int:
        """Requests that were running at ``t``."""
        return sum(o.started < t < o.ended for o in self.outcomes)

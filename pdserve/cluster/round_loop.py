"""What the controller's loops share (``Supervisor``, ``Autoscaler``, ``RoleBalancer``): one
round every ``interval_s`` on a daemon thread of its own, a round's error logged and the loop
kept going, ``halt`` to stop acting at once and ``stop`` to also wait for the thread."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class RoundLoop:
    name = "loop"  # for the thread's name and the log line of a failed round

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pdserve-{self.name}", daemon=True)

    def round(self) -> None:
        """One round's work; ``_stop.is_set()`` says the cluster began to stop."""
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        """Act no more from now on (the cluster is stopping); a round under way may finish."""
        self._stop.set()

    def stop(self, join_s: float = 60.0) -> None:
        self.halt()
        self._thread.join(join_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.round()
            except Exception:  # keep going whatever one round hit
                log.exception("%s round failed", self.name)

"""Shutdown that always ends: whatever happened before (workers killed, replaced, hung), a
SIGINT or SIGTERM to ``pdserve serve`` or to its process group drains, then the process exits
within the drain grace plus ``MARGIN_S`` and leaves no process of its own behind.

Why it did not always (issue 25):
- A signal to the process group reaches every Ray process too. Each ``ServerActor`` drains and
  exits on SIGTERM, and the supervisor, still running through the drain, took them for dead
  workers and started replacements: new ServerActors nobody would stop.
- Once the group's SIGTERM has ended the GCS, every Ray call of the driver blocks (up to 60 s:
  "Failed to connect to GCS"), and ``ray.shutdown()``, which ends the processes Ray started,
  is reached late or never.
- A process whose parent died (a worker of a raylet that exited) is re-parented to init, out
  of reach of ``ray.shutdown()``.

So the driver becomes a child subreaper (``become_subreaper``): every process it started,
however deep, stays its descendant. A stop signal stops supervising at once; ``StopDeadline``
ends the process at the deadline whatever the orderly stop is waiting for; and after the
orderly stop, any descendant still alive is terminated, then killed (``end_descendants``).

``StopDeadline``'s timer is a Python thread, so it cannot run while another thread holds the
GIL inside a C call (a Ray call blocked on a lost GCS can). Under it lies ``faulthandler``'s
watchdog, a C thread that needs no GIL: half a second before the promise runs out it writes
every thread's stack to stderr and exits 1, so a stop that hangs both ends and says where.
``dump_stacks_on`` gives an operator the same dump on demand (``kill -USR1``), without
stopping anything.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

MARGIN_S = 10.0  # the promise: exit within the drain grace plus this
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
TERM_WAIT_S = 2.0  # how long descendants get to exit on SIGTERM before SIGKILL
_BACKSTOP_EARLY_S = 0.5  # the C watchdog fires this long before the promise runs out


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (Linux); False
    where the kernel does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def dump_stacks_on(sig: int = signal.SIGUSR1) -> None:
    """On ``sig``, every thread's Python stack goes to stderr (C-level: it works while the
    GIL is held elsewhere); the process goes on."""
    faulthandler.register(sig, file=sys.stderr, all_threads=True, chain=False)


def descendants(root: int | None = None) -> list[int]:
    """Live processes below ``root`` (default: this process), from /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # a zombie has already ended; it only waits to be reaped
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap() -> None:
    """Collect the exit status of every ended child (orphans adopted as subreaper included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_descendants(term_wait_s: float = TERM_WAIT_S) -> list[int]:
    """SIGTERM every descendant, SIGKILL those alive ``term_wait_s`` later; returns the pids
    that were still running."""
    left = descendants()
    if not left:
        return []
    _signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + term_wait_s
    while descendants() and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    _signal_all(descendants(), signal.SIGKILL)
    time.sleep(0.05)
    _reap()
    return left


class StopDeadline:
    """Ends this process ``after_s`` from ``start()`` (descendants first) unless ``cancel()``ed
    before: the bound on a stop that waits on a Ray that is already gone. If the timer thread
    cannot run (the GIL held in C), the watchdog ends the process ``TERM_WAIT_S`` later, less
    ``_BACKSTOP_EARLY_S``, with every thread's stack on stderr."""

    def __init__(self, after_s: float):
        self.after_s = after_s
        self.backstop_s = after_s + TERM_WAIT_S - _BACKSTOP_EARLY_S
        self._timer = threading.Timer(after_s, self._fire)
        self._timer.daemon = True

    def start(self) -> None:
        faulthandler.dump_traceback_later(self.backstop_s, exit=True, file=sys.stderr)
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()
        faulthandler.cancel_dump_traceback_later()

    def _fire(self) -> None:
        print(f"pdserve: the stop did not finish within {self.after_s:g} s; ending every process it started",
              flush=True)
        end_descendants(term_wait_s=1.0)
        os._exit(1)

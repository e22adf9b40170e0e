"""A tensor-parallel worker's other ranks as processes: started, waited for, killed
(pdserve/engine/distributed/group.py holds them)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Callable

from pdserve.engine.errors import RankLost

START_TIMEOUT_S = 600.0  # for every rank to join and load its share (a big model reads for minutes)


def spawn(spec, entry: str) -> subprocess.Popen:
    """Start one rank (``python -m entry SPEC``). Its stdin is a pipe that only rank 0 holds: it
    closes when rank 0's process ends, however it ends, and the rank then exits too."""
    fds = tuple(fd for fd in (spec.cache_fd, spec.service_fd) if fd >= 0)
    return subprocess.Popen([sys.executable, "-m", entry, spec.to_json()], stdin=subprocess.PIPE, pass_fds=fds)


def wait_for(procs: list[subprocess.Popen], done: Callable[[], bool], what: str) -> None:
    """Poll until ``done()``; a rank that exits meanwhile, or the start-up timeout, raises RankLost."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        for rank, proc in enumerate(procs, start=1):
            if proc.poll() is not None:
                raise RankLost(f"tensor-parallel rank {rank} exited with status {proc.returncode} before it "
                               f"could {what} (its log is in this worker's)")
        if done():
            return
        if time.monotonic() > deadline:
            raise RankLost(f"tensor-parallel ranks did not {what} within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()

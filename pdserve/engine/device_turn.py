"""One worker's start at a time on a device: a lock file per device, held from before the first
reading of its memory until the engine is built.

Workers that share a device each size their cache from what they measure as they start
(pdserve/engine/memory.py): the device's free memory must hold their share, and on CUDA their
use counts the device memory lost since their first reading. Two workers starting together
would each read the other's loading as their own use, and each find the other's share still
free. So a worker takes its device's turn first (``device_turn``) and keeps it through its
weights, its profile step, its KV cache and its CUDA graphs: a second worker on that device
waits, then measures the device as the first one left it. Waiting is logged, naming the lock.

The lock is ``flock`` on a file named after the device in ``LOCK_DIR``, so it holds between the
processes of one host that see the same directory (containers sharing a GPU share it only if
they share that directory), and it goes with its process, however that ends. Keys
(``turn_keys``): each CUDA device by its UUID (the same GPU under any ``CUDA_VISIBLE_DEVICES``),
every rank's device of a tensor-parallel worker, taken in sorted order so that two workers never
wait on each other; ``host-ram`` for a CPU worker sized by a share of RAM (a CPU worker of an
exact size measures nothing and waits for nothing).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)
LOCK_DIR = Path(tempfile.gettempdir()) / "pdserve-device-locks"
HOST_RAM = "host-ram"


def turn_keys(device: torch.device, ranks: int, measured: bool) -> tuple[str, ...]:
    """The locks a worker on ``device`` with ``ranks`` ranks takes to start (module docstring);
    ``measured``: its cache is sized by a share of its memory."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        first = device.index if device.index is not None else torch.cuda.current_device()
        indices = {first} | {r % count for r in range(1, ranks)}  # rank 0's, then distributed.group.rank_device's
        return tuple(sorted(f"cuda-{torch.cuda.get_device_properties(i).uuid}" for i in indices))
    return (HOST_RAM,) if measured else ()


@contextlib.contextmanager
def device_turn(keys: tuple[str, ...], directory: Path | None = None) -> Iterator[None]:
    """Hold the lock of each of ``keys`` (sorted) for the ``with`` block, waiting for them in turn."""
    directory = directory or LOCK_DIR
    with contextlib.ExitStack() as held:
        for key in sorted(keys):
            held.enter_context(_locked(directory, key))
        yield


@contextlib.contextmanager
def _locked(directory: Path, key: str) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(directory, 0o1777)  # every user's workers share it; each removes only its own files
    path = directory / f"{key}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another worker's start on %s to end (%s)", key, path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the lock goes with it

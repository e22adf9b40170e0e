"""Shared factories for kv_transfer tests: caches with known contents and a holder agent
running in its own OS process, driven over a multiprocessing Pipe.

Metadata crosses the Pipe as serialized protobuf bytes, standing in for the gRPC channel
the workers use.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch

from pdserve.kv_transfer import create_agent
from pdserve.protos import kv_transfer_pb2

# (layers, K/V, tokens, kv heads, head dim) in bf16: 768 bytes per block, block-first.
BLOCK_SHAPE = (2, 2, 4, 3, 8)
BLOCK_BYTES = 2 * 2 * 4 * 3 * 8 * 2
BACKENDS = ("nixl", "tcp")
_CTX = mp.get_context("spawn")  # fork would share the parent's UCX state


def make_cache(num_blocks: int, seed: int | None = None, block_shape: tuple[int, ...] = BLOCK_SHAPE) -> torch.Tensor:
    """A bf16 block-first cache: zeros, or seeded values identical in every process."""
    shape = (num_blocks, *block_shape)
    if seed is None:
        return torch.zeros(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (bf16 compared as raw bytes)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _holder_main(conn, backend: str, name: str, num_blocks: int, seed: int, shard: dict | None = None,
                 block_shape: tuple[int, ...] = BLOCK_SHAPE) -> None:
    """Child process: own a cache (with ``shard``: its rank's heads of a tensor-parallel
    cache, ``tp_helpers``), publish metadata, answer commands until 'stop'."""
    if shard is None:
        agent = create_agent(backend, name, make_cache(num_blocks, seed, block_shape))
    else:
        from tp_helpers import rank_agent
        agent = rank_agent(backend, name, num_blocks, seed, shard)
    conn.send(agent.local_metadata().SerializeToString())
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            agent.close()
            conn.send("stopped")
            return
        if cmd == "checksums":  # the holder's checksums of (block ids, last block bytes)
            conn.send(agent.block_checksums(*arg))
            continue
        if cmd == "flip":  # invert one byte (block, offset) of the cache: a fault in the holder's memory
            block, offset = arg
            row = agent.cache.view(agent.cache.shape[0], -1).view(torch.uint8)[block]
            row[offset] ^= 0xFF
            conn.send("flipped")
            continue
        if cmd == "notifs":  # collect notifications for up to `arg` seconds
            want, timeout_s = arg
            got: list[bytes] = []
            deadline = time.monotonic() + timeout_s
            while len(got) < want and time.monotonic() < deadline:
                got += agent.get_notifications()
                time.sleep(0.005)
            got += agent.get_notifications()
            conn.send(got)


class Holder:
    """A holder agent in a spawned process, with its metadata already received."""

    def __init__(self, backend: str, name: str = "holder", num_blocks: int = 16,
                 seed: int = 1234, shard: dict | None = None, block_shape: tuple[int, ...] = BLOCK_SHAPE):
        self.backend, self.name, self.num_blocks, self.seed = backend, name, num_blocks, seed
        self.block_shape = block_shape
        self._conn, child = _CTX.Pipe()
        self.process = _CTX.Process(target=_holder_main,
                                    args=(child, backend, name, num_blocks, seed, shard, block_shape), daemon=True)
        self.process.start()
        deadline = time.monotonic() + 60
        while not self._conn.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"holder {name!r} ({backend}) died at start, exit code "
                                   f"{self.process.exitcode}")
            if time.monotonic() > deadline:
                self.process.kill()
                raise TimeoutError(f"holder {name!r} ({backend}) did not start within 60 s")
        self.metadata_bytes: bytes = self._conn.recv()

    def metadata(self) -> kv_transfer_pb2.AgentMetadata:
        """The holder's metadata, parsed from the bytes it sent."""
        return kv_transfer_pb2.AgentMetadata.FromString(self.metadata_bytes)

    def expected_cache(self) -> torch.Tensor:
        """The holder's cache contents, rebuilt from the same seed."""
        return make_cache(self.num_blocks, self.seed, self.block_shape)

    def notifications(self, want: int, timeout_s: float = 5.0) -> list[bytes]:
        """Notifications the holder received, waiting up to ``timeout_s`` for ``want``."""
        self._conn.send(("notifs", (want, timeout_s)))
        return self._conn.recv()

    def checksums(self, block_ids: list[int], last_block_bytes: int | None = None) -> tuple[int, ...]:
        """The holder agent's checksums of its ``block_ids`` (``block_checksums``)."""
        self._conn.send(("checksums", (block_ids, last_block_bytes)))
        return self._conn.recv()

    def flip(self, block: int, offset: int) -> None:
        """Invert the byte at ``offset`` of the holder's ``block``; twice puts it back."""
        self._conn.send(("flip", (block, offset)))
        assert self._conn.recv() == "flipped"

    def kill(self) -> None:
        """SIGKILL the holder: the peer disappears without any goodbye."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def pause(self) -> None:
        """SIGSTOP the holder: alive, connections open, but it answers nothing."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused holder."""
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Close the holder's agent and end its process (kills it if it hangs)."""
        if self.process.is_alive():
            try:
                self._conn.send(("stop", None))
                if self._conn.poll(10):
                    self._conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

"""A Kubernetes ClusterIP Service for pods run as podman containers: one fixed address whose
connections kube-proxy spreads over the Service's endpoints.

Podman's DNS cannot stand in for it: a network alias shared by two containers resolves to
both addresses in a fixed order, so every client (gRPC picks the first address that answers)
would reach the same pod, where kube-proxy picks an endpoint at random for each new
connection. This proxy does what kube-proxy does: each accepted TCP connection goes to one
endpoint picked at random, and stays there when that endpoint later leaves the list
(conntrack keeps it) until one side closes it. The test edits the endpoints as the endpoints
controller would.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

LAG_CHECK_S = 0.1  # how often the proxy's loop checks that it runs on time
STALL_S = 0.5  # a check this late is recorded in ``Service.stalls``


class Service:
    """Listens on ``host:port`` and forwards each connection to ``<endpoint>:target_port``."""

    def __init__(self, host: str, port: int, target_port: int):
        self.address, self.target_port = f"{host}:{port}", target_port
        self._endpoints: tuple[str, ...] = ()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._forward, host, port),
                                                        self._loop).result(timeout=10)
        # Stalls of the proxy's own loop (it runs in the test's process): (wall time, seconds late).
        # A stalled proxy delays every byte of every connection, which a peer may read as a dead link.
        self.stalls: list[tuple[float, float]] = []
        self._watcher = asyncio.run_coroutine_threadsafe(self._watch_lag(), self._loop)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints

    def add(self, ip: str) -> None:
        with self._lock:
            self._endpoints = tuple(sorted({*self._endpoints, ip}))

    def remove(self, ip: str) -> None:
        with self._lock:
            self._endpoints = tuple(e for e in self._endpoints if e != ip)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop_watching(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _stop_watching(self) -> None:
        self._watcher.cancel()  # the task itself, on its loop: it ends before the loop stops
        await asyncio.gather(asyncio.wrap_future(self._watcher), return_exceptions=True)

    async def _watch_lag(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(LAG_CHECK_S)
            late = time.monotonic() - start - LAG_CHECK_S
            if late > STALL_S:
                self.stalls.append((round(time.time(), 1), round(late, 2)))

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoints = self._endpoints
        if not endpoints:  # kube-proxy rejects a connection to a Service without endpoints
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(random.choice(endpoints), self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until either side ends, then close the writer (which ends the other direction too)."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()

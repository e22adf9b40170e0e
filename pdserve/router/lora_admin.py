"""Loading and unloading LoRA adapters across the cluster, and keeping every worker's set equal
to the router's table (``pdserve.router.adapters``).

``load``: every live worker of both pools (``LoadLoRA``; the prefill worker computes the
adapter's KV, the decode worker decodes with it) loads the adapter, then the table lists it and
requests may name it; a worker's refusal (a path that is no PEFT adapter, a rank over
``--max-lora-rank``, a module the model lacks) undoes the load on the others and is answered
400 naming the field. ``unload``: the table drops it first (new requests get the 404), then
every worker (one whose requests still use it keeps it until they end: the sync unloads it then). A worker that does not answer is no reason to fail: ``sync`` gives it the table
after its next answered stats poll, as it does a worker that joins later (``Join``, the
controller's table, a restart): after each poll, the adapters the router lists and the worker
lacks are loaded there, and those it holds that the router does not list are unloaded.

Whether the endpoints change anything: only with ``--allow-runtime-lora-updating``
(``AdapterTable.runtime_updates``; vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Without it they
answer 403 naming the flag, and the adapters served are ``--lora-modules``' (the per-poll sync
still gives them to every worker). A load makes every worker read a directory of its host's,
so it is the operator's to turn on, not the default.

Who may call them (``may_administer``): without API keys, whoever reaches the public port, as
for every other endpoint; with ``--api-key``, its holder; with ``--api-keys-file``, the tenants
whose entry says ``admin: true`` (others: 403).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.engine.sampling.params import MAX_LORA_NAME_CHARS
from pdserve.protos import worker_pb2
from pdserve.router.adapters import Adapter, AdapterTable
from pdserve.router.http_errors import HttpError
from pdserve.router.pool import WorkerClient, WorkerPool
from pdserve.router.tenants import Tenant
from pdserve.router.worker_calls import detach, error_field

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0  # a load reads the adapter's weights from disk on every worker at once
SYNC_RETRY_S = 10.0  # a worker that failed to load an adapter at sync is asked again this much later


def may_administer(keys, tenant: Tenant | None) -> bool:
    """Whether a caller may load and unload adapters: anyone without API keys (``keys`` None),
    else a tenant with the right (the single ``--api-key``'s, or ``admin: true`` in the file)."""
    return keys is None or (tenant is not None and tenant.limits.admin)


class LoRAAdmin:
    """The load and unload actions over ``pool``'s workers, and the per-poll ``sync``."""

    def __init__(self, table: AdapterTable, base_names: tuple[str, ...], pool: WorkerPool):
        self.table, self.base_names, self.pool = table, base_names, pool
        self.lock = asyncio.Lock()  # one change at a time; sync waits its turn out (skips)
        self._syncing: set[str] = set()  # worker addresses a sync is under way for
        self._retry_at: dict[tuple[str, str], float] = {}  # (address, name) -> monotonic time

    async def load(self, name: str, path: str) -> None:
        """Load ``name`` from ``path`` on every live worker, then serve it; ``HttpError`` naming
        the field for a refusal."""
        self._check_name(name)
        if not isinstance(path, str) or not path:
            raise HttpError(400, "lora_path: must be a non-empty string (the adapter's PEFT directory)",
                            param="lora_path")
        async with self.lock:
            if name in self.base_names or name in self.table:
                raise HttpError(400, f"The lora adapter `{name}` has already been loaded.", param="lora_name")
            workers = self._live()
            results = await asyncio.gather(*(self._call(w, "LoadLoRA", name, path) for w in workers),
                                           return_exceptions=True)
            refused = next((r for r in results if _invalid(r)), None)
            if refused is not None:
                await asyncio.gather(*(self._call(w, "UnloadLoRA", name) for w, r in zip(workers, results)
                                       if isinstance(r, worker_pb2.LoadLoRAResponse) and r.loaded),
                                     return_exceptions=True)
                raise HttpError(400, refused.details(), param=error_field(refused))
            for w, r in zip(workers, results):
                if isinstance(r, BaseException):  # it gets the adapter at an answered poll (sync)
                    log.warning("worker %s did not load LoRA adapter %s now (%s); it is given it later",
                                w.address, name, r)
            self.table.add(Adapter(name, path))
        log.info("LoRA adapter %s loaded from %s on %d worker(s)", name, path, len(workers))

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` and unload it from every worker; 404 for a name not served."""
        self._check_name(name)
        async with self.lock:
            if name not in self.table:
                raise HttpError(404, f"The lora adapter `{name}` cannot be found.", "NotFoundError", "lora_name")
            self.table.remove(name)
            await asyncio.gather(*(self._call(w, "UnloadLoRA", name) for w in self._live()), return_exceptions=True)
        log.info("LoRA adapter %s unloaded", name)

    def sync(self, client: WorkerClient) -> None:
        """After ``client``'s answered stats poll: start making its adapters the table's (see the
        module doc). Skipped while a load or unload runs, or one sync for it does."""
        s = client.stats
        if s is None or not s.lora_enabled or self.lock.locked() or client.address in self._syncing:
            return
        now = time.monotonic()
        held = set(s.lora_names)
        missing = [a for a in self.table.adapters() if a.name not in held
                   and self._retry_at.get((client.address, a.name), 0.0) <= now]
        extra = sorted(name for name in held - set(self.table.names())
                       if self._retry_at.get((client.address, name), 0.0) <= now)
        if missing or extra:
            self._syncing.add(client.address)
            detach(self._sync(client, missing, extra))

    async def _sync(self, client: WorkerClient, missing: list[Adapter], extra: list[str]) -> None:
        try:
            for adapter in missing:
                try:
                    await self._call(client, "LoadLoRA", adapter.name, adapter.path)
                    self._retry_at.pop((client.address, adapter.name), None)
                    log.info("worker %s given LoRA adapter %s", client.address, adapter.name)
                except grpc.aio.AioRpcError as exc:
                    self._retry_at[(client.address, adapter.name)] = time.monotonic() + SYNC_RETRY_S
                    log.warning("worker %s could not load LoRA adapter %s: %s", client.address, adapter.name,
                                exc.details())
            for name in extra:
                try:
                    await self._call(client, "UnloadLoRA", name)
                except grpc.aio.AioRpcError as exc:  # its requests still use it: after they end
                    self._retry_at[(client.address, name)] = time.monotonic() + SYNC_RETRY_S
                    log.info("worker %s keeps LoRA adapter %s for now: %s", client.address, name, exc.details())
        finally:
            self._syncing.discard(client.address)

    def _live(self) -> list[WorkerClient]:
        """The workers a change goes to now: answering, and running with --enable-lora."""
        return [w for w in self.pool.workers.values()
                if w.healthy and not w.hung and w.stats is not None and w.stats.lora_enabled]

    async def _call(self, client: WorkerClient, method: str, name: str, path: str = ""):
        """One LoRA RPC; its answer's list of held adapters becomes the router's view of the
        worker at once (the routing preference must not wait for the next poll to see a load)."""
        if method == "LoadLoRA":
            answer = await client.stub.LoadLoRA(worker_pb2.LoadLoRARequest(lora_name=name, lora_path=path),
                                                timeout=LOAD_TIMEOUT_S)
        else:
            answer = await client.stub.UnloadLoRA(worker_pb2.UnloadLoRARequest(lora_name=name),
                                                  timeout=LOAD_TIMEOUT_S)
        if client.stats is not None:
            del client.stats.lora_names[:]
            client.stats.lora_names.extend(answer.lora_names)
            del client.stats.lora_fingerprints[:]  # not in the answer: unknown until the next poll

        return answer

    def _check_name(self, name: object) -> None:
        if not self.table.enabled:
            raise HttpError(400, "lora_name: this cluster serves no LoRA adapters: start it with --enable-lora",
                            param="lora_name")
        if not self.table.runtime_updates:
            raise HttpError(403, "loading and unloading LoRA adapters at run time is off: start the router with "
                                 "--allow-runtime-lora-updating (PDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1), or name the "
                                 "adapters in --lora-modules", "PermissionDeniedError")
        if not isinstance(name, str) or not name:
            raise HttpError(400, "lora_name: must be a non-empty string", param="lora_name")
        if len(name) > MAX_LORA_NAME_CHARS or not name.isprintable():
            raise HttpError(400, f"lora_name: must be printable and at most {MAX_LORA_NAME_CHARS} characters",
                            param="lora_name")


def _invalid(result: object) -> bool:
    return isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.INVALID_ARGUMENT

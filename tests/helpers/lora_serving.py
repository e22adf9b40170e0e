"""A served cluster in this process for the LoRA serving tests: real prefill and decode workers
(their gRPC servers, NIXL between them) and the real router (gRPC and OpenAI HTTP), all on one
event loop of a thread of its own, over the tiny random Llama and adapters written in PEFT's
format (tests/helpers/lora.py). Every prompt goes to the prefill pool (no local prefill)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import urllib.error
import urllib.request

from pdserve.engine.config import LoRAConfig
from pdserve.engine.loader import materialize
from pdserve.router import server as router_server
from pdserve.router.limits import RouterLimits
from tests.factories import decode_worker_config, engine_config, prefill_worker_config

MAX_LORA_RANK = 8


class LoRACluster:
    """``decode_lora``: per decode worker, whether it runs with --enable-lora (a worker without
    it can hold no adapter: the router must route adapters' requests past it)."""

    def __init__(self, model_dir, modules: tuple[tuple[str, str], ...], decode_lora=(True,), num_blocks: int = 128,
                 served_name: str = "tiny", max_lora_rank: int = MAX_LORA_RANK, step_trace_dir: str | None = None,
                 **engine):
        """``engine``: further ``tests.factories.engine_config`` arguments (``dtype``: float32 by default);
        ``step_trace_dir``: each worker appends its engine steps to ``<dir>/<worker_id>.steps.jsonl``
        (``pdserve.engine.core.step_trace``); None: no trace."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        lora = LoRAConfig(max_loras=4, max_lora_rank=max_lora_rank, modules=modules)
        self.engine = dataclasses.replace(engine_config(model_dir, num_blocks=num_blocks, **engine), lora=lora)
        self.served_name = served_name
        self.plain_engine = dataclasses.replace(self.engine, lora=None)
        self.step_trace_dir = step_trace_dir
        self.servers, self.workers, self.router = [], [], None
        self._run(self._start(decode_lora))

    def _run(self, coro, timeout_s: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self, decode_lora) -> None:
        from pdserve.decode_worker.server import start as start_decode
        from pdserve.decode_worker.worker import DecodeWorker
        from pdserve.prefill_worker.server import start as start_prefill
        from pdserve.prefill_worker.worker import PrefillWorker

        prefill = PrefillWorker(prefill_worker_config(worker_id="prefill-0", engine=self.engine,
                                                      step_trace_dir=self.step_trace_dir))
        decoders = [DecodeWorker(decode_worker_config(worker_id=f"decode-{i}", step_trace_dir=self.step_trace_dir,
                                                      engine=self.engine if on else self.plain_engine))
                    for i, on in enumerate(decode_lora)]
        self.workers = [prefill, *decoders]
        self.servers = [await start_prefill(prefill.config, prefill)]
        self.servers += [await start_decode(d.config, d) for d in decoders]
        self.router = await router_server.start(router_server.RouterConfig(
            engine=self.engine, served_model_names=(self.served_name,), tokenizer=str(materialize("default", progress=False)),
            grpc_port=0, http_port=0, prefill_addresses=(self.servers[0].address,),
            decode_addresses=tuple(s.address for s in self.servers[1:]), stats_interval_s=0.1,
            limits=RouterLimits(), allow_runtime_lora_updating=True))  # the tests load adapters at run time
        while not self.router.service.pool.ready():
            await asyncio.sleep(0.05)

    @property
    def grpc_address(self) -> str:
        return self.router.address

    def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
        """(status, body text) of an HTTP POST to the router."""
        req = urllib.request.Request(f"http://{self.router.http_address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://{self.router.http_address}{path}", timeout=30) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        async def stop():
            if self.router is not None:
                await self.router.stop()
            for s in self.servers:
                await s.stop()

        try:
            self._run(stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)

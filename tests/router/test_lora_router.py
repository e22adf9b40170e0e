"""LoRA adapters in the router, without workers' engines: the model -> adapter mapping and vLLM's
404, the routing preference for workers holding the adapter (pure), /v1/models, who may load
and unload, and the admin's fan-out, roll-back and per-poll sync over fake worker stubs."""

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import grpc
import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc, worker_pb2
from pdserve.router.adapters import Adapter, AdapterTable, UnknownModel
from pdserve.router.auth import ApiKeys
from pdserve.router.frontend import ModelInfo, validate
from pdserve.router.http_errors import HttpError
from pdserve.router.limits import RouterLimits
from pdserve.router.lora_admin import LoRAAdmin
from pdserve.router.policy import WorkerSnapshot, pick_decode, prefer_holders
from pdserve.router.pool import WorkerClient, WorkerPool
from pdserve.router.service import GenerationService
from pdserve.router.tenants import Tenant, TenantLimits
from pdserve.wire.grpc_util import aio_server, bind
from tests.helpers.http_front import request, serve_in_thread
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool, rpc_error


def model_with(*adapters: tuple[str, str], runtime_updates: bool = False) -> ModelInfo:
    """The router's model with ``adapters`` served; ``runtime_updates``: --allow-runtime-lora-updating."""
    return ModelInfo("base", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer(), aliases=("alias",),
                     adapters=AdapterTable(enabled=True, modules=adapters, runtime_updates=runtime_updates))


def generate(model: str = "", lora_name: str = "") -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(model=model, text="hi", sampling=pdserve_pb2.SamplingParams(
        max_tokens=4, lora_name=lora_name))


def test_a_request_runs_the_adapter_its_model_names_and_the_base_model_under_its_names():
    model = model_with(("sql", "/a/sql"))
    assert validate(generate("sql"), model).params.lora_name == "sql"
    for name in ("", "base", "alias"):
        assert validate(generate(name), model).params.lora_name == ""
    assert validate(generate("", lora_name="sql"), model).params.lora_name == "sql"  # gRPC's own field


def test_an_unknown_model_is_vllms_404_naming_model():
    with pytest.raises(UnknownModel) as err:
        validate(generate("nope"), model_with(("sql", "/a/sql")))
    assert err.value.field == "model" and err.value.reason.startswith("The model `nope` does not exist. Served: ")
    assert "'sql'" in err.value.reason
    with pytest.raises(UnknownModel, match="sampling.lora_name: The model `gone` does not exist"):
        validate(generate("", lora_name="gone"), model_with())
    with pytest.raises(InvalidRequestError, match="sampling.lora_name: names adapter 'sql' but model is 'base'"):
        validate(generate("base", lora_name="sql"), model_with(("sql", "/a/sql")))


def grpc_generate(model: ModelInfo, request: pdserve_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str, str]:
    """``request`` through a real router gRPC server over fake workers: (code, details, the
    trailing pdserve-field)."""
    async def main():
        service = GenerationService(model, fake_pool([FakePrefill()], [FakeDecode()]), RouterLimits())
        server = aio_server()
        address = bind(server, "127.0.0.1", 0)
        service.add_to(server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                try:
                    async for _ in pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details(), dict(exc.trailing_metadata() or ()).get("pdserve-field", "")
                return grpc.StatusCode.OK, "", ""
        finally:
            await server.stop(None)

    return asyncio.run(main())


def test_an_unknown_model_or_adapter_over_grpc_is_not_found_naming_the_field():
    """vLLM's and OpenAI's answer is "not found" (HTTP 404): over gRPC, NOT_FOUND, never
    INVALID_ARGUMENT; the adapter served runs, and a contradiction between the two fields is
    still bad input."""
    def generate(model: str = "", lora_name: str = "") -> pdserve_pb2.GenerateRequest:
        return pdserve_pb2.GenerateRequest(model=model, token_ids=pdserve_pb2.TokenIds(ids=[5, 6]),
                                           sampling=pdserve_pb2.SamplingParams(max_tokens=2, lora_name=lora_name))

    model = model_with(("sql", "/a/sql"))
    code, details, field = grpc_generate(model, generate("nope"))
    assert code == grpc.StatusCode.NOT_FOUND and field == "model" and "The model `nope` does not exist" in details
    code, details, field = grpc_generate(model, generate("", lora_name="gone"))
    assert code == grpc.StatusCode.NOT_FOUND and field == "sampling.lora_name" and "`gone`" in details
    assert grpc_generate(model, generate("sql"))[0] == grpc.StatusCode.OK
    code, _, field = grpc_generate(model, generate("base", lora_name="sql"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field == "sampling.lora_name"


def snap(worker_id: str, role: str, loras=None, **kw) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id, role, healthy=True, blocks_total=100, loras=loras, **kw)


def test_routing_prefers_the_workers_holding_the_adapter_in_each_pool_and_falls_back_to_all():
    workers = [snap("p0", "prefill", frozenset()), snap("p1", "prefill", frozenset({"sql"})),
               snap("d0", "decode", frozenset({"sql"}), blocks_used=90), snap("d1", "decode", frozenset()),
               snap("d2", "mixed", None)]
    routable = {w.worker_id for w in prefer_holders(workers, "sql") if w.routable}
    assert routable == {"p1", "d0"}
    # the busier holder still wins over an idle worker that lacks the adapter
    assert pick_decode(prefer_holders(workers, "sql"), 1).worker_id == "d0"
    assert pick_decode(workers, 1).worker_id == "d1"
    assert prefer_holders(workers, "") == workers  # the base model: every worker
    nobody = {w.worker_id for w in prefer_holders(workers, "chat") if w.routable}
    assert nobody == {"p0", "p1", "d0", "d1"}  # no holder: those with LoRA (d2 runs without)
    no_lora = [snap("p0", "prefill"), snap("d0", "decode")]
    assert prefer_holders(no_lora, "chat") == no_lora  # nobody with LoRA: as before (each refuses it)
    down = [dataclasses.replace(workers[1], healthy=False), *workers[:1], *workers[2:]]
    assert {w.worker_id for w in prefer_holders(down, "sql") if w.role == "prefill" and w.routable} == {"p0"}


class LoRAStub:
    """A worker's LoRA RPCs: holds names; refuses a path containing ``bad`` as the engine would."""

    def __init__(self, held=(), fail: grpc.StatusCode | None = None, refuses: bool = True):
        self.held, self.fail, self.calls, self.refuses = set(held), fail, [], refuses

    async def LoadLoRA(self, req, timeout=None):
        self.calls.append(("load", req.lora_name))
        if self.fail is not None:
            raise rpc_error(self.fail, "gone")
        if "bad" in req.lora_path and self.refuses:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(("pdserve-field", "lora_path")),
                                       "lora_path: rank 64 is over max_lora_rank=16")
        loaded = req.lora_name not in self.held
        self.held.add(req.lora_name)
        return worker_pb2.LoadLoRAResponse(loaded=loaded, lora_names=sorted(self.held))

    async def UnloadLoRA(self, req, timeout=None):
        self.calls.append(("unload", req.lora_name))
        found = req.lora_name in self.held
        self.held.discard(req.lora_name)
        return worker_pb2.UnloadLoRAResponse(found=found, lora_names=sorted(self.held))


def lora_pool(stubs: dict[str, LoRAStub]) -> WorkerPool:
    pool = WorkerPool()
    for address, stub in stubs.items():
        pool.workers[address] = WorkerClient("prefill" if address.startswith("p") else "decode", address, None, stub,
                                             stats=worker_pb2.WorkerStats(lora_enabled=True), healthy=True)
    return pool


def test_a_load_reaches_every_worker_and_a_refusal_undoes_it_on_the_others():
    # p0 takes what d0 refuses (say, another host's copy of the adapter differs): p0 must undo it
    stubs = {"p0": LoRAStub(refuses=False), "d0": LoRAStub(), "d1": LoRAStub(fail=grpc.StatusCode.UNAVAILABLE)}
    table = AdapterTable(enabled=True, runtime_updates=True)
    admin = LoRAAdmin(table, ("base",), lora_pool(stubs))

    async def main():
        await admin.load("sql", "/a/sql")  # d1 does not answer: no reason to fail (it is synced later)
        with pytest.raises(HttpError) as err:
            await admin.load("sql", "/a/sql")
        assert err.value.status == 400 and err.value.param == "lora_name" and "already been loaded" in str(err.value)
        with pytest.raises(HttpError) as err:
            await admin.load("big", "/a/bad")
        assert err.value.status == 400 and err.value.param == "lora_path" and "max_lora_rank" in str(err.value)
        with pytest.raises(HttpError) as err:
            await admin.unload("nope")
        assert err.value.status == 404 and str(err.value) == "The lora adapter `nope` cannot be found."
        await admin.unload("sql")

    asyncio.run(main())
    assert table.names() == () and stubs["p0"].held == stubs["d0"].held == set()
    assert stubs["p0"].calls == [("load", "sql"), ("load", "big"), ("unload", "big"), ("unload", "sql")]
    assert stubs["d0"].calls == [("load", "sql"), ("load", "big"), ("unload", "sql")]  # refused: nothing to undo


def test_a_worker_that_joins_or_missed_a_change_is_given_the_routers_table_at_its_next_poll():
    stubs = {"d0": LoRAStub(held={"old"}), "d1": LoRAStub()}
    table = AdapterTable(enabled=True, modules=(("sql", "/a/sql"), ("chat", "/a/chat")))
    pool = lora_pool(stubs)
    admin = LoRAAdmin(table, ("base",), pool)
    pool.workers["d0"].stats = worker_pb2.WorkerStats(lora_enabled=True, lora_names=["old"])
    pool.workers["d1"].stats = worker_pb2.WorkerStats(lora_enabled=False)  # no --enable-lora: left alone

    async def main():
        admin.sync(pool.workers["d0"])
        admin.sync(pool.workers["d0"])  # one sync at a time per worker
        admin.sync(pool.workers["d1"])
        for _ in range(50):
            await asyncio.sleep(0.01)
            if not admin._syncing:
                return

    asyncio.run(main())
    assert stubs["d0"].held == {"sql", "chat"} and stubs["d1"].calls == []
    assert stubs["d0"].calls == [("load", "sql"), ("load", "chat"), ("unload", "old")]


@pytest.fixture
def front():
    """The HTTP front over fake workers, with one adapter served and run-time updates allowed;
    (address, service)."""
    service = GenerationService(model_with(("sql", "/a/sql"), runtime_updates=True),
                                fake_pool([FakePrefill()], [FakeDecode()]), RouterLimits())
    address, stop = serve_in_thread(service)
    yield address, service
    stop()


def test_models_lists_the_base_names_then_each_adapter_with_its_parent_and_root(front):
    address, _ = front
    status, _, body = request(address, "GET", "/v1/models")
    cards = {c["id"]: c for c in json.loads(body)["data"]}
    assert status == 200 and list(cards) == ["base", "alias", "sql"]
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == "/a/sql" and cards["base"]["parent"] is None
    status, _, body = request(address, "GET", "/v1/models/sql")
    assert status == 200 and json.loads(body)["root"] == "/a/sql"


def test_a_completion_for_an_unknown_model_is_vllms_404(front):
    address, _ = front
    status, _, body = request(address, "POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "hi"}).encode())
    error = json.loads(body)["error"]
    assert status == 404 and error["message"].startswith("The model `nope` does not exist. Served: ") and error["param"] == "model"
    assert error["type"] == "NotFoundError"


def test_bad_admin_bodies_are_400_naming_the_field_and_unknown_unloads_404(front):
    address, _ = front
    for path, body, param in [("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
                              ("/v1/load_lora_adapter", {"lora_path": "/x"}, "lora_name"),
                              ("/v1/unload_lora_adapter", {}, "lora_name")]:
        status, _, raw = request(address, "POST", path, json.dumps(body).encode())
        assert status == 400 and json.loads(raw)["error"]["param"] == param
    status, _, raw = request(address, "POST", "/v1/unload_lora_adapter", json.dumps({"lora_name": "nope"}).encode())
    assert status == 404 and json.loads(raw)["error"]["param"] == "lora_name"


def test_only_an_admin_key_may_load_or_unload(tmp_path):
    admin_key, user_key = "sk-admin-0123456789abcdef", "sk-user-0123456789abcdef"
    keys = ApiKeys(((ApiKeys.single(admin_key).entries[0][0], Tenant("ops", TenantLimits(admin=True))),
                    (ApiKeys.single(user_key).entries[0][0], Tenant("team"))))
    service = GenerationService(model_with(runtime_updates=True), fake_pool([FakePrefill()], [FakeDecode()]),
                                RouterLimits(), keys=keys)
    address, stop = serve_in_thread(service)
    try:
        body = json.dumps({"lora_name": "nope"}).encode()
        status, _, raw = request(address, "POST", "/v1/unload_lora_adapter", body, {"Authorization": f"Bearer {user_key}"})
        assert status == 403 and "admin" in json.loads(raw)["error"]["message"]
        status, _, _ = request(address, "POST", "/v1/unload_lora_adapter", body, {"Authorization": f"Bearer {admin_key}"})
        assert status == 404  # past the check: no such adapter
    finally:
        stop()


def test_without_the_opt_in_run_time_loads_and_unloads_are_403_naming_the_flag():
    """vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING; pdserve, --allow-runtime-lora-updating.
    Without it neither endpoint changes anything, whoever calls, and the table stays
    --lora-modules'."""
    service = GenerationService(model_with(("sql", "/a/sql")), fake_pool([FakePrefill()], [FakeDecode()]),
                                RouterLimits())
    address, stop = serve_in_thread(service)
    try:
        for path, body in [("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/a/chat"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "sql"})]:
            status, _, raw = request(address, "POST", path, json.dumps(body).encode())
            assert status == 403 and "--allow-runtime-lora-updating" in json.loads(raw)["error"]["message"], path
        assert service.model.adapters.names() == ("sql",)
    finally:
        stop()


def test_without_enable_lora_an_adapter_load_is_refused_naming_the_flag():
    table = AdapterTable(enabled=False)
    with pytest.raises(HttpError, match="--enable-lora"):
        asyncio.run(LoRAAdmin(table, ("base",), WorkerPool()).load("sql", "/a/sql"))


def test_the_table_keeps_the_load_order():
    table = AdapterTable(enabled=True, modules=(("b", "/b"),))
    table.add(Adapter("a", "/a"))
    assert table.names() == ("b", "a") and table.lora_name("a", ("base",)) == "a"


def test_the_kv_index_never_matches_one_adapters_blocks_for_anothers_request():
    from pdserve.engine.core.block_hashes import kv_salt
    from pdserve.engine.sampling.params import SamplingParams
    from pdserve.router.kv_index import KVIndex

    index, prompt = KVIndex(), list(range(100, 164))  # four full blocks of 16
    index.apply("w", worker_pb2.CacheEvents(epoch="e1", snapshot=True), 16)  # a worker that publishes
    index.expect("w", prompt, kv_salt(SamplingParams(lora_name="sql"), "f1"))
    assert index.overlaps(prompt, ["w"], kv_salt(SamplingParams(lora_name="sql"), "f1"))["w"] == 48
    assert index.overlaps(prompt, ["w"], kv_salt(SamplingParams(lora_name="chat"), "f1")).get("w", 0) == 0
    assert index.overlaps(prompt, ["w"], kv_salt(SamplingParams(), "f1")).get("w", 0) == 0  # nor the base model's

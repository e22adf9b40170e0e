"""Fields only the router may set are refused from clients at the public front, over real
gRPC: ``sampling.structured_output.resumed_tokens`` told the engine that the prompt's tail was
output already generated under the grammar, and a client that set it broke every request
batched with its own (issue 25). The workers are in-process fakes: the refusal is the
router's, before any routing."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.frontend import ModelInfo
from pdserve.router.limits import RouterLimits
from pdserve.router.service import GenerationService
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, LetterTokenizer, fake_pool
from pdserve.wire.grpc_util import aio_server, bind


def generate(request: pdserve_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str, str]:
    """The request through a real router gRPC server: (code, details, trailing pdserve-field)."""
    async def main():
        model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
        service = GenerationService(model, fake_pool([FakePrefill()], [FakeDecode()]), RouterLimits())
        server = aio_server()
        address = bind(server, "127.0.0.1", 0)
        service.add_to(server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details(), dict(exc.trailing_metadata() or ()).get("pdserve-field", "")
                return grpc.StatusCode.OK, "", ""
        finally:
            await server.stop(None)

    return asyncio.run(main())


def regex_request(resumed_tokens: int) -> pdserve_pb2.GenerateRequest:
    so = pdserve_pb2.StructuredOutput(regex="[0-9]+", resumed_tokens=resumed_tokens)
    return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[5, 6, 7]), sampling=pdserve_pb2.SamplingParams(max_tokens=4, structured_output=so))


def test_resumed_tokens_from_a_client_is_invalid_argument_naming_the_field():
    code, details, field = generate(regex_request(2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert field == "sampling.structured_output.resumed_tokens" and "router" in details


def test_the_same_request_without_it_is_served():
    """The refusal is of the field, not of structured output: left 0, the request runs."""
    code, details, _ = generate(regex_request(0))
    assert code == grpc.StatusCode.OK, details


@pytest.mark.parametrize("request_id", ["a\nINFO forged line", "a\rb", "tab\there", "nul\x00", "del\x7f", "c1\x85"])
def test_a_request_id_with_control_characters_is_refused_naming_it(request_id):
    """Request ids go into the router's and workers' text logs: a newline in one would forge
    a log line."""
    request = pdserve_pb2.GenerateRequest(request_id=request_id, token_ids=pdserve_pb2.TokenIds(ids=[5, 6]),
                                          sampling=pdserve_pb2.SamplingParams(max_tokens=2))
    code, details, field = generate(request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field == "request_id" and "control" in details


def test_a_printable_request_id_is_served():
    request = pdserve_pb2.GenerateRequest(request_id="client-7 é/ü:ok", token_ids=pdserve_pb2.TokenIds(ids=[5, 6]),
                                          sampling=pdserve_pb2.SamplingParams(max_tokens=2))
    assert generate(request)[0] == grpc.StatusCode.OK


def abort(request_id: str) -> tuple[grpc.StatusCode, str, str]:
    """``Abort`` of ``request_id`` through a real router gRPC server: (code, details, trailing
    pdserve-field); OK when the router answered (found or not)."""
    async def main():
        model = ModelInfo("m", SimpleNamespace(vocab_size=1000), 4096, 16, LetterTokenizer())
        service = GenerationService(model, fake_pool([FakePrefill()], [FakeDecode()]), RouterLimits())
        server = aio_server()
        address = bind(server, "127.0.0.1", 0)
        service.add_to(server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                try:
                    await pdserve_pb2_grpc.GenerationStub(channel).Abort(
                        pdserve_pb2.AbortRequest(request_id=request_id), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details(), dict(exc.trailing_metadata() or ()).get("pdserve-field", "")
                return grpc.StatusCode.OK, "", ""
        finally:
            await server.stop(None)

    return asyncio.run(main())


@pytest.mark.parametrize("request_id", ["a\nINFO forged line", "a\rb", "tab\there", "nul\x00", "del\x7f", "c1\x85"])
def test_abort_refuses_a_request_id_with_control_characters_naming_it(request_id):
    """Abort takes a client's id as Generate does, and logs it as Generate does: the same refusal."""
    code, details, field = abort(request_id)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field == "request_id" and "control" in details


def test_abort_refuses_a_request_id_over_the_limit_naming_it():
    code, details, field = abort("x" * (RouterLimits().requests.max_request_id_chars + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field == "request_id" and "max_request_id_chars" in details


def test_abort_of_a_printable_unknown_id_is_answered_not_found():
    assert abort("client-7 é/ü:ok")[0] == grpc.StatusCode.OK

"""Stop strings are applied once, by the router, which detokenizes for the client anyway:
workers never see them (they build no detokenizer), and a hit ends the client's stream and
cancels the decode worker's request at once. Fake worker stubs (no model needed)."""

import asyncio
import dataclasses

from pdserve.protos import pdserve_pb2
from pdserve.router.request_run import RequestRun
from tests.metrics.metrics_helpers import FakeDecode, FakePrefill, _DecodeCall, fake_pool, request_run


class RecordingDecode(FakeDecode):
    def __init__(self):
        super().__init__()
        self.calls: list[_DecodeCall] = []
        self.cancelled = 0

    def Decode(self, request, timeout=None):
        call = super().Decode(request)
        call.cancel = lambda: setattr(self, "cancelled", self.cancelled + 1)
        self.calls.append(call)
        return call


def test_a_stop_string_ends_the_stream_and_cancels_the_decode_request():
    decode = RecordingDecode()
    plain = request_run(fake_pool([FakePrefill()], [decode]), max_tokens=50)
    req = dataclasses.replace(plain.req, params=dataclasses.replace(plain.req.params, stop=("e",)))
    run = RequestRun(req, plain.model, plain.pool, plain.limits)

    async def collect():
        return [r async for r in run.responses()]

    responses = asyncio.run(collect())
    # Tokens: 1 from prefill ("b"), then 2, 3, 4 ... ("c", "d", "e" ...): "e" stops it.
    assert "".join(r.text for r in responses) == "bcd"
    assert responses[-1].finish_reason == pdserve_pb2.FINISH_REASON_STOP
    assert [list(r.token_ids) for r in responses] == [[1], [2], [3], [4]]  # the stop token counts; its text does not
    (call,) = decode.calls
    assert not call.request.sampling.stop and call.request.sampling.max_tokens == 50
    assert decode.cancelled == 1  # the worker's request ends with the client's stream

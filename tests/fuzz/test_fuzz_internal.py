"""The internal gRPC plane under garbage and hostile fields, against a live cluster: every
worker RPC and RouterAdmin RPC gets random bytes and well-formed messages with hostile
values (edge integers, NaN, odd strings, long lists, unknown lease tokens and request ids).
No call may end UNKNOWN (a servicer that raised, or a message its deserializer could not
read), none may hang, no process may die, and afterwards the cluster still serves greedy
tokens equal to transformers. (Blocks are not checked here: a fuzzed Prefill holds its KV
for the lease, as a real one that nobody claims does.)

Left out on purpose: ``Drain`` (a valid empty message drains a worker for good, as it
should), and random bytes to RPCs whose messages carry addresses (``Decode``,
``SetMembership``): the worker or router would dial whatever a random string names. Their
hostile messages name only loopback addresses.
"""

import time

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import given
from hypothesis import strategies as st

from pdserve.protos import admin_pb2, worker_pb2
from tests.fuzz.conftest import assert_no_process_died
from tests.helpers.fuzz import CLIENT_TIMEOUT_S, PROTO_FLOATS, SAFE_TEXT, fuzz_settings

pytestmark = pytest.mark.slow

_P, _D, _A = "/pdserve.v1.PrefillWorker/", "/pdserve.v1.DecodeWorker/", "/pdserve.v1.RouterAdmin/"
# (method, request class, streams its answer, may take random bytes)
RPCS = [
    (_P + "Prefill", worker_pb2.PrefillRequest, False, True),
    (_P + "PrefillStream", worker_pb2.PrefillRequest, True, True),
    (_P + "WatchKV", worker_pb2.WatchKVRequest, True, True),
    (_P + "Release", worker_pb2.ReleaseRequest, False, True),
    (_P + "Claim", worker_pb2.ClaimRequest, False, True),
    (_P + "GetAgentMetadata", worker_pb2.AgentMetadataRequest, False, True),
    (_P + "Abort", worker_pb2.WorkerAbortRequest, False, True),
    (_P + "Stats", worker_pb2.StatsRequest, False, True),
    (_D + "Decode", worker_pb2.DecodeRequest, True, False),
    (_D + "Abort", worker_pb2.WorkerAbortRequest, False, True),
    (_D + "Stats", worker_pb2.StatsRequest, False, True),
    (_A + "SetMembership", admin_pb2.Membership, False, False),
    (_A + "GetMembership", admin_pb2.Membership, False, True),
    (_A + "GetLatency", admin_pb2.LatencyRequest, False, True),
]
BAD_CODES = {grpc.StatusCode.UNKNOWN}
LOOPBACK = st.sampled_from(["", "127.0.0.1:1", "127.0.0.1:0", "[::1]:1", "127.0.0.1:99999", "127.0.0.1"])
EDGE = {F.TYPE_UINT32: st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1), st.just(2**32 - 1)),
        F.TYPE_UINT64: st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1)),
        F.TYPE_FIXED64: st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1)),  # checksums
        F.TYPE_FIXED32: st.integers(0, 2**32 - 1),
        F.TYPE_INT32: st.integers(-(2**31), 2**31 - 1), F.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
        F.TYPE_FLOAT: PROTO_FLOATS, F.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
        F.TYPE_BOOL: st.booleans(), F.TYPE_STRING: SAFE_TEXT, F.TYPE_BYTES: st.binary(max_size=16)}


@st.composite
def hostile(draw, cls, depth: int = 0):
    """A well-formed ``cls`` with hostile values in any of its fields (addresses: loopback only)."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for k, v in draw(st.dictionaries(EDGE[key.type], EDGE[value.type], max_size=3)).items():
                getattr(msg, field.name)[k] = v
            continue
        if field.type == F.TYPE_MESSAGE:
            if depth < 2:
                items = draw(st.lists(hostile(field.message_type._concrete_class, depth + 1), max_size=3)) \
                    if field.is_repeated else [draw(hostile(field.message_type._concrete_class, depth + 1))]
                for item in items:
                    (getattr(msg, field.name).add() if field.is_repeated
                     else getattr(msg, field.name)).CopyFrom(item)
            continue
        if field.type == F.TYPE_ENUM:
            value = st.integers(-3, 8)
        elif "address" in field.name:
            value = LOOPBACK
        elif field.name in ("max_tokens", "min_tokens"):  # hostile lengths are the public fuzz's; here, speed
            value = st.integers(0, 2)
        else:
            value = EDGE[field.type]
        if field.is_repeated:
            getattr(msg, field.name).extend(draw(st.lists(value, max_size=40)))
        else:
            setattr(msg, field.name, draw(value))
    return msg


def call(channel: grpc.Channel, method: str, streams: bool, payload: bytes) -> grpc.StatusCode:
    try:
        if streams:
            for _ in channel.unary_stream(method)(payload, timeout=CLIENT_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(method)(payload, timeout=CLIENT_TIMEOUT_S)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert exc.code() not in BAD_CODES, (method, exc.code(), exc.details())
        assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, (method, "hung")
        return exc.code()


def target(cluster, method: str) -> str:
    if method.startswith(_P):
        return cluster.prefill_addresses[0]
    if method.startswith(_D):
        return cluster.decode_addresses[0]
    return cluster.admin_address


@pytest.mark.parametrize("method,cls,streams", [r[:3] for r in RPCS if r[3]], ids=lambda v: str(v).rsplit("/")[-1])
def test_internal_random_bytes(cluster, method, cls, streams):
    with grpc.insecure_channel(target(cluster, method)) as channel:
        @fuzz_settings(40)
        @given(raw=st.binary(max_size=256))
        def run(raw):
            call(channel, method, streams, raw)

        run()


@pytest.mark.parametrize("method,cls,streams", [r[:3] for r in RPCS], ids=lambda v: str(v).rsplit("/")[-1])
def test_internal_hostile_fields(cluster, method, cls, streams):
    with grpc.insecure_channel(target(cluster, method)) as channel:
        @fuzz_settings(40)
        @given(req=hostile(cls))
        def run(req):
            call(channel, method, streams, req.SerializeToString())

        run()


def test_zz_afterwards_nothing_died_blocks_are_free_and_greedy_equals_transformers(cluster):
    from pdserve.protos import pdserve_pb2_grpc
    from tests.factories import CHAT_QUESTIONS as QUESTIONS, default_reference
    from tests.helpers.chat import assert_chat_greedy, chat_request, collect

    assert_no_process_died(cluster)
    ref = default_reference()
    deadline = time.monotonic() + 60  # a hostile SetMembership lasts until the controller's next round
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        while True:
            try:
                ids, _, _ = collect(stub.Generate(chat_request(QUESTIONS[0], 16), timeout=120))
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the cluster did not serve again after the fuzz"
                time.sleep(1)
    assert_chat_greedy(ref, QUESTIONS[0], ids, 16)

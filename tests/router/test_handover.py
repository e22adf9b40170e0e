"""A router's hand-over behind a Service (``pdserve.router.handover``), on the transport alone:
no client call fails while the old router leaves.

The race it closes: gRPC's stop refuses every call that has not reached a handler, and a call
the client sent on its open connection just before it saw the stop's GOAWAY ends CANCELLED
(a fresh-clone suite once failed one request of 223 so, in the plain-k8s rolling test). With a
connection age, the old router serves on while each connection is sent GOAWAY, the clients'
next calls go through the Service to the new router, and nothing is left to race the stop.
Measured while writing this: 16 of 30 such hand-overs without the age cut a call, none of 30
with it.

The servers are real gRPC servers built as the router builds its public one
(``wire.grpc_util.aio_server``); their service is a stand-in for ``Generation`` (a stream of
three messages) with the counters ``hand_over`` reads. The Service is tests/deploy/service.py's
kube-proxy model. The whole router's roll runs in tests/deploy/test_image.py.
"""

import asyncio
import collections
import threading

import grpc

from pdserve.router.handover import hand_over
from pdserve.wire.grpc_util import aio_server, bind
from pdserve.wire.server import RunningServer, add_health
from tests.deploy.service import Service

AGE_S = 1.0  # longer than the load runs before the hand-over: the clients are still on the old router then
ROUNDS = 5  # without the age about half the hand-overs cut a call: 5 miss it with odds of about 1 in 40
CLIENTS = 8
METHOD = "/pdserve.test.Streams/Generate"


class Streams:
    """What ``hand_over`` reads of a router's service, and the calls this server answered."""

    def __init__(self):
        self.unready, self.running, self.waiting, self.answered = False, set(), 0, 0

    async def generate(self, request, context):
        call = object()
        self.running.add(call)
        try:
            for _ in range(3):
                await asyncio.sleep(0.01)
                yield b"token"
            self.answered += 1
        finally:
            self.running.discard(call)


async def router_at(host: str, port: int) -> RunningServer:
    streams = Streams()
    server = aio_server(connection_age_s=AGE_S)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.test.Streams", {
        "Generate": grpc.unary_stream_rpc_method_handler(streams.generate)}),))
    address = bind(server, host, port)
    health = add_health(server, [])
    await server.start()
    return RunningServer(address, server, health, service=streams)


def load(address: str, stop: threading.Event, outcomes: collections.Counter) -> tuple[grpc.Channel, list]:
    """``CLIENTS`` threads calling one after another on one channel, as the rolling test's clients do."""
    channel = grpc.insecure_channel(address)
    generate = channel.unary_stream(METHOD)

    def client():
        while not stop.is_set():
            try:
                outcomes["OK" if len(list(generate(b"", timeout=10))) == 3 else "short"] += 1
            except grpc.RpcError as exc:
                outcomes[f"{exc.code().name}: {exc.details()}"] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    return channel, threads


async def one_roll(service: Service, port: int, outcomes: collections.Counter) -> tuple[int, int]:
    old, new = await router_at("127.0.0.2", port), await router_at("127.0.0.3", port)
    service.add("127.0.0.2")
    stop = threading.Event()
    channel, threads = load(service.address, stop, outcomes)
    await asyncio.sleep(0.3)
    service.remove("127.0.0.2")  # the old pod leaves the endpoints,
    service.add("127.0.0.3")
    await asyncio.sleep(0.2)  # its preStop sleeps, then SIGTERM: the hand-over
    before = old.service.answered
    left = await hand_over(old, 0.0, 5.0, AGE_S)
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.to_thread(lambda: [t.join(timeout=15) for t in threads])
    channel.close()
    served_during = old.service.answered - before
    await new.server.stop(0)
    service.remove("127.0.0.3")
    assert left == 0
    return served_during, new.service.answered


def test_a_hand_over_behind_a_service_fails_no_call():
    port = _free_port()
    service = Service("127.0.0.1", _free_port(), port)
    outcomes = collections.Counter()
    try:
        rolls = [asyncio.run(one_roll(service, port, outcomes)) for _ in range(ROUNDS)]
    finally:
        service.close()
    assert set(outcomes) == {"OK"}, dict(outcomes)
    for during, by_new in rolls:  # the old router still served while its clients left, and they did leave
        assert during > 0 and by_new > 0, rolls


def _free_port() -> int:
    """A port free on both loopback addresses the two routers bind."""
    import socket

    for _ in range(20):
        with socket.socket() as a:
            a.bind(("127.0.0.2", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.3", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no port free on both 127.0.0.2 and 127.0.0.3")

"""Checks of a served cluster under faults and rollouts (tests/faults, tests/serving): the
undisturbed run, the load's outcomes against it, the router's migrations, a busy worker to
disturb, no KV left held, reads held back for a while, a process gone."""

import concurrent.futures
import contextlib
import time
import urllib.request

import grpc

from tests.faults.load import Outcome
from tests.helpers.chat import chat_request, collect
from tests.serving.conftest import worker_stats

CLEAN_WITHIN_S = 20.0  # no KV held this long after a load (far below the tests' leases)


def greedy_at_once(stub, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy chat tokens (``ignore_eos``) on the cluster as it is, asked all at
    once: batched or alone, a sequence's tokens are the same (the engine's batch-invariant
    kernels), as the loads checked against them run several at once too. Each request's own
    waits (a KV read held back by ``inject_transfer_delay_s``) overlap."""
    def one(prompt: str) -> list[int]:
        return collect(stub.Generate(chat_request(prompt, max_tokens, ignore_eos=True), timeout=120))[0]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def check(outcomes: list[Outcome], reference: dict, max_tokens: int) -> None:
    errors = [(o.prompt, o.code.name, o.details) for o in outcomes if o.code is not None]
    assert not errors, f"{len(errors)} of {len(outcomes)} requests failed: {errors[:5]}"
    for o in outcomes:
        assert o.tokens == reference[(o.prompt, max_tokens)], f"prompt {o.prompt}: tokens differ from the undisturbed run"


def migrations(cluster) -> float:
    """The router's ``pdserve:request_migrations_total``."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdserve:request_migrations_total"):
                return float(line.split()[-1])
    return 0.0


def assert_no_kv_held(cluster) -> None:
    live = [(role, a) for role in ("prefill", "decode") for a in cluster.addresses(role)]
    deadline = time.monotonic() + CLEAN_WITHIN_S
    while True:
        busy = {a: (s.num_blocks_used, s.num_held_leases) for role, a in live
                if (s := worker_stats(a, role)).num_blocks_used or s.num_held_leases}
        if not busy:
            return
        assert time.monotonic() < deadline, f"KV still held {CLEAN_WITHIN_S} s after the load: {busy}"
        time.sleep(0.2)


def busy(decode_addresses: list[str], timeout_s: float = 30.0) -> str:
    """One of ``decode_addresses`` that runs a stream right now."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for address in decode_addresses:
            if worker_stats(address, "decode").num_running:
                return address
        time.sleep(0.02)
    raise AssertionError(f"none of {decode_addresses} ran a stream within {timeout_s} s")


def busy_worker(cluster, role: str, field: str, timeout_s: float = 30.0) -> int:
    """The slot of a ``role`` worker whose stats ``field`` is non-zero right now."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for index, address in enumerate(list(cluster.addresses(role))):
            try:
                if getattr(worker_stats(address, role), field):
                    return index
            except grpc.RpcError:
                continue
        time.sleep(0.02)
    raise AssertionError(f"no {role} worker had {field} > 0 within {timeout_s} s")


def fresh_claim(cluster, younger_than_s: float, timeout_s: float = 30.0) -> int:
    """The slot of a prefill worker that granted a claim less than ``younger_than_s`` ago, for
    certain: its ``num_claimed_leases`` rose between two polls that began less than that long
    before this returns. A worker seen merely holding a claim may have granted it long ago (a
    poll of a busy worker on a loaded machine can take a second), and its read be over."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, tuple[float, int]] = {}  # address -> (when its last poll was sent, what it saw)
    while time.monotonic() < deadline:
        for index, address in enumerate(list(cluster.addresses("prefill"))):
            sent = time.monotonic()
            try:
                claimed = worker_stats(address, "prefill").num_claimed_leases
            except grpc.RpcError:
                last.pop(address, None)
                continue
            before = last.get(address)
            last[address] = (sent, claimed)
            if before is not None and claimed > before[1] and time.monotonic() - before[0] < younger_than_s:
                return index
        time.sleep(0.01)
    raise AssertionError(f"no prefill worker granted a claim seen within {younger_than_s} s in {timeout_s} s")


@contextlib.contextmanager
def reads_delayed(cluster, delay_s: float):
    """Within the block every KV read the cluster's decode workers start is posted ``delay_s``
    after its claim (``ServerActor.inject_fault("read_delay")``): the window in which a test
    sees a first token before its KV has moved, or stops a holder while a read from it is open.
    Only a test that needs the window pays it. Afterwards the decode workers then in the
    cluster read at once again (a replacement started meanwhile reads at once from its start)."""
    import ray

    for actor in list(cluster.decode):
        ray.get(actor.inject_fault.remote("read_delay", True, delay_s), timeout=10)
    try:
        yield
    finally:
        for actor in list(cluster.decode):
            ray.get(actor.inject_fault.remote("read_delay", False), timeout=10)


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True

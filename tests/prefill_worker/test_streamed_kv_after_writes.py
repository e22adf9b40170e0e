"""A streamed prompt's chunk is announced only after the device has written its KV (issue
26): on CUDA the step that computed a chunk may still be running when the hook after it
announces the chunk, and a decode worker reads the blocks as soon as it hears. The blocks the
chunk finished are checksummed in between: after the writes, before the announcement that
carries their checksums.

No GPU here: ``wait_for_writes`` is replaced by a recorder, and the test checks that it ran
on the worker's device before every announcement reached a stream, and not when there was
nothing to announce. That CUDA's stream synchronize is what it calls is read, not run."""

import types

import torch

import pdserve.prefill_worker.worker as worker_module
from pdserve.engine.attention.kv_cache import KVCacheSpec
from pdserve.kv_transfer.handoff import LeaseTable
from pdserve.prefill_worker.kv_stream import KVEarly, KVReady
from pdserve.prefill_worker.record import RequestRecord
from pdserve.prefill_worker.worker import PrefillWorker


class FakeEngine:
    device = torch.device("cuda", 0)

    def __init__(self):
        self.progress = {}
        self.blocks = types.SimpleNamespace(block_table=lambda request_id: [3, 4], block_size=16)
        self.cache_spec = KVCacheSpec(num_layers=1, block_size=16, num_kv_heads=1, head_dim=2, dtype=torch.bfloat16)

    def prompt_progress(self, request_id):
        return self.progress.get(request_id, 0)


def _worker(monkeypatch, events):
    """A PrefillWorker with only what ``_publish_kv`` touches (no model, no agent)."""
    w = PrefillWorker.__new__(PrefillWorker)
    w.engine = FakeEngine()
    w.leases = LeaseTable()
    w.config = types.SimpleNamespace(lease_seconds=30.0, verify_kv=True)

    def block_checksums(ids, last):
        events.append(("checksum", tuple(ids)))
        return tuple(ids)

    w.agent = types.SimpleNamespace(block_checksums=block_checksums)
    w.records = {"r1": RequestRecord("r1", owner="", arrived_at=0.0, prompt_hashes=None, stream_kv=True)}
    w._expect_reads = lambda: None
    w.push = lambda items: events.extend(("push", type(item).__name__, item.checksums) for _, item in items)
    monkeypatch.setattr(worker_module, "wait_for_writes", lambda device: events.append(("wait", device)))
    return w


def test_each_announcement_waits_for_the_device(monkeypatch):
    events = []
    w = _worker(monkeypatch, events)
    w.engine.progress["r1"] = 16  # the first chunk ran: the lease comes with it
    w._publish_kv()
    w.engine.progress["r1"] = 32  # the next chunk
    w._publish_kv()
    dev = FakeEngine.device
    assert events == [("wait", dev), ("checksum", (3,)), ("push", KVEarly.__name__, (3,)),
                      ("wait", dev), ("checksum", (4,)), ("push", KVReady.__name__, (3, 4))]


def test_nothing_new_waits_for_nothing(monkeypatch):
    """A step that moved no streamed prompt costs no device sync."""
    events = []
    w = _worker(monkeypatch, events)
    w._publish_kv()  # no chunk yet
    assert ("wait", FakeEngine.device) not in events


def test_the_wait_is_a_no_op_on_the_cpu():
    from pdserve.engine.device import wait_for_writes

    wait_for_writes(torch.device("cpu"))  # must not touch torch.cuda (absent here)

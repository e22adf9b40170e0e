"""NIXL fits the host (issue 26): the wheel built for torch's CUDA is the one imported, a
host where none loads gets an error naming both and the CUDA version, and every thread that
calls into NIXL has the cache's CUDA device current first.

CUDA is absent here: the module choice runs on fake modules under a faked
``torch.version.cuda``; the device binding runs on fake ``torch.cuda`` calls, and its
coverage of NIXL calls on real NIXL agents over host caches with a recording binder."""

import os
import sys
import threading
import types

import pytest
import torch
from kv_helpers import make_cache

import pdserve.kv_transfer.nixl_backend as nixl_backend
from pdserve.kv_transfer import create_agent
from pdserve.kv_transfer.errors import BackendUnavailable
from pdserve.kv_transfer.nixl_backend import _import_nixl, cuda_binder, nixl_modules_for


@pytest.mark.parametrize("cuda,modules", [(None, ("nixl_cu12", "nixl_cu13")), ("12.8", ("nixl_cu12",)),
                                          ("13.0", ("nixl_cu13",)), ("11.8", ())])
def test_modules_follow_torchs_cuda(cuda, modules):
    assert nixl_modules_for(cuda) == modules


@pytest.fixture
def installed(monkeypatch):
    """Fake NIXL modules: ``installed(cuda, *names)`` fakes torch's CUDA and makes exactly
    ``names`` importable."""

    def install(cuda, *names):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        for name in ("nixl_cu12", "nixl_cu13"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name) if name in names else None)

    return install


@pytest.mark.parametrize("cuda,present,chosen", [
    ("13.0", ("nixl_cu12", "nixl_cu13"), "nixl_cu13"),
    ("12.8", ("nixl_cu12", "nixl_cu13"), "nixl_cu12"),
    (None, ("nixl_cu12", "nixl_cu13"), "nixl_cu12"),  # a CPU torch takes nixl_cu12, as before
    (None, ("nixl_cu13",), "nixl_cu13"),
])
def test_the_wheel_for_torchs_cuda_is_imported(installed, cuda, present, chosen):
    installed(cuda, *present)
    assert _import_nixl().__name__ == chosen


def test_a_cuda13_torch_never_takes_nixl_cu12(installed):
    """nixl_cu12's UCX CUDA module needs libcudart.so.12, which a CUDA 13 torch lacks: its
    VRAM registration would fail later, and less clearly."""
    installed("13.0", "nixl_cu12")
    with pytest.raises(BackendUnavailable) as err:
        _import_nixl()
    message = str(err.value)
    assert "CUDA 13.0" in message and "nixl_cu12: not tried" in message and "nixl_cu13: ModuleNotFoundError" in message
    assert "install nixl-cu13" in message


def test_neither_loading_names_both_modules_and_the_cuda_version(installed):
    installed("12.4")
    with pytest.raises(BackendUnavailable, match="CUDA 12.4") as err:
        create_agent("nixl", "no-nixl", make_cache(2))
    assert "nixl_cu12: ModuleNotFoundError" in str(err.value) and "nixl_cu13: not tried" in str(err.value)
    assert err.value.backend == "nixl"


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index: types.SimpleNamespace(query=lambda: calls.append(("query", index))))
    return calls


def test_a_host_cache_binds_nothing(fake_cuda):
    cuda_binder(torch.device("cpu"))()
    assert fake_cuda == []


def test_each_thread_binds_the_cache_device_once(fake_cuda):
    bind = cuda_binder(torch.device("cuda", 1))
    bind()
    bind()
    assert fake_cuda == [("set_device", 1), ("query", 1)]
    worker = threading.Thread(target=bind)
    worker.start()
    worker.join()
    assert fake_cuda == [("set_device", 1), ("query", 1)] * 2


class _Checked:
    """A real NIXL agent whose every method first checks that its thread was bound."""

    def __init__(self, agent, bound: set[int], misses: list[str]):
        self._agent, self._bound, self._misses = agent, bound, misses

    def __getattr__(self, name):
        value = getattr(self._agent, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            if threading.get_ident() not in self._bound:
                self._misses.append(f"{name} on {threading.current_thread().name}")
            return value(*args, **kwargs)

        return call


def _on_thread(fn, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), name=f"caller-{fn.__name__}")
    thread.start()
    thread.join()
    return out[0]


def test_every_nixl_call_runs_on_a_bound_thread(monkeypatch):
    """Metadata, add_remote, a read, its poll, notifications and close, each from a thread
    of its own as gRPC handlers and the engine call them, and the progress thread."""
    real = nixl_backend._import_nixl()
    bound: set[int] = set()
    misses: list[str] = []

    def binder(device):
        return lambda: bound.add(threading.get_ident())

    def make_agent(name, config):
        if threading.get_ident() not in bound:
            misses.append(f"nixl_agent on {threading.current_thread().name}")
        return _Checked(real.nixl_agent(name, config), bound, misses)

    fake = types.SimpleNamespace(nixl_agent_config=real.nixl_agent_config, nixl_agent=make_agent)
    monkeypatch.setattr(nixl_backend, "_import_nixl", lambda: fake)
    monkeypatch.setattr(nixl_backend, "cuda_binder", binder)
    holder = create_agent("nixl", "holder", make_cache(4, seed=1))
    reader = create_agent("nixl", "reader", make_cache(4))
    try:
        peer = _on_thread(reader.add_remote, _on_thread(holder.local_metadata))
        handle = _on_thread(reader.start_read, peer, [1, 2], [0, 3], b"done")
        assert _on_thread(reader.wait, handle, 10.0).name == "DONE"
        notes = []
        for _ in range(200):
            notes += _on_thread(holder.get_notifications)
            if notes:
                break
        assert notes == [b"done"]
    finally:
        _on_thread(reader.close)
        _on_thread(holder.close)
    assert misses == []


def test_a_cuda_cache_enables_cuda_ipc_reads_unless_the_operator_chose(monkeypatch):
    """pdserve's transfers are READs; UCX turns cuda_ipc GETs on only where it sees NVLink, so a
    CUDA cache asks for them (BENCHMARKS.md, GPU: 0.45 GB/s VRAM to VRAM without)."""
    from pdserve.kv_transfer.nixl_backend import _ucx_env, ucx_settings

    assert ucx_settings(torch.device("cpu"), None) == {"UCX_NET_DEVICES": ""}
    cuda = ucx_settings(torch.device("cuda", 0), "eth1")
    assert cuda == {"UCX_NET_DEVICES": "eth1", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto")
    with _ucx_env(cuda):
        assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto"  # the operator's
        assert os.environ["UCX_NET_DEVICES"] == "eth1"
    assert "UCX_NET_DEVICES" not in os.environ

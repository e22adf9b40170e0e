"""Starting a local Ray: a GCS server that does not come up in time gets one more start.

Ray's GCS not publishing its port within Ray's 30 s cannot be caused on demand, so these tests
stand a fake in for ``ray.init`` (and ``ray.shutdown``); the rest of ``start_local_ray`` and ``LocalCluster._init_ray`` is real.
"""

import pytest

import pdserve.cluster.ray_start as ray_start
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.local import LocalCluster

GCS_TIMEOUT = RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_0123abcd")


class FakeRay:
    def __init__(self, failures: list[Exception]):
        self.failures = list(failures)
        self.inits = 0
        self.shutdowns = 0

    def init(self, **kwargs):
        self.inits += 1
        assert kwargs["address"] == "local"
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    def install(failures):
        fake = FakeRay(failures)
        monkeypatch.setattr(ray_start.ray, "init", fake.init)
        monkeypatch.setattr(ray_start.ray, "shutdown", fake.shutdown)
        return fake
    return install


def test_a_gcs_that_did_not_come_up_is_started_once_more(fake_ray):
    fake = fake_ray([GCS_TIMEOUT])
    c = LocalCluster(ClusterConfig())
    c._init_ray()
    assert (fake.inits, fake.shutdowns) == (2, 1)
    assert c._started_ray


def test_a_second_gcs_timeout_is_raised(fake_ray):
    fake = fake_ray([GCS_TIMEOUT, GCS_TIMEOUT])
    c = LocalCluster(ClusterConfig())
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        c._init_ray()
    assert fake.inits == ray_start.RAY_START_ATTEMPTS == 2


def test_any_other_start_failure_is_raised_at_once(fake_ray):
    fake = fake_ray([RuntimeError("object store memory too small")])
    c = LocalCluster(ClusterConfig())
    with pytest.raises(RuntimeError, match="object store"):
        c._init_ray()
    assert (fake.inits, fake.shutdowns) == (1, 0)


@pytest.mark.parametrize("token_auth", [True, False])
def test_a_cluster_starts_its_own_ray_with_the_token_auth_its_config_asks(monkeypatch, token_auth):
    """``ray_token_auth`` (on by default) reaches ``start_local_ray``, whose Ray with token auth
    on refuses a driver without the token (tests/security/test_cluster_security.py)."""
    import pdserve.cluster.local as local

    asked = []
    monkeypatch.setattr(local, "start_local_ray", lambda num_cpus, auth: asked.append(auth))
    c = LocalCluster(ClusterConfig(ray_token_auth=token_auth))
    c._init_ray()
    assert asked == [token_auth] and c._started_ray
    assert ClusterConfig().ray_token_auth  # on unless a config turns it off


def test_a_local_ray_starts_its_workers_at_niceness_0(fake_ray, monkeypatch):
    """Ray's raylet starts workers at niceness 15 unless RAY_worker_niceness says otherwise."""
    monkeypatch.delenv(ray_start.WORKER_NICENESS_ENV, raising=False)
    fake_ray([])
    ray_start.start_local_ray(num_cpus=2, token_auth=True)
    assert ray_start.os.environ[ray_start.WORKER_NICENESS_ENV] == "0"


def test_a_worker_raises_every_thread_to_niceness_0():
    """A worker on a Ray that started it at 15 (another Ray's default) runs at 0 after
    ``normal_priority``, the thread it started while still at 15 included."""
    import os
    import threading

    from pdserve.cluster.actors import normal_priority

    ready, done = threading.Event(), threading.Event()
    tids = []

    def worker():
        tids.append(threading.get_native_id())
        ready.set()
        done.wait(10)

    before = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=worker)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 15)  # this thread: its new thread inherits 15
        thread.start()
        ready.wait(10)
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == 15
        normal_priority()
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == 0
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0
    finally:
        done.set()
        thread.join()
        os.setpriority(os.PRIO_PROCESS, 0, before)

"""Starting a local Ray: a GCS server that does not come up in time gets one more start.

Ray's GCS not publishing its port within Ray's 30 s cannot be caused on demand, so these tests
stand a fake in for ``ray.init`` (and ``ray.shutdown``); the rest of ``start_local_ray`` and ``LocalCluster._init_ray`` is real.
"""

import pytest

import cluster.ray_start as ray_start
from cluster.local import ClusterConfig, LocalCluster

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

"""Starting the Ray a local cluster runs in: its authentication mode, and one more start when
Ray's GCS server does not come up in time."""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)

RAY_START_ATTEMPTS = 2  # a local Ray whose GCS server does not come up is started once more
# Ray starts its worker processes at niceness 15 unless told otherwise, so on a small host the
# router, the load and Ray's own daemons preempted the engines. Workers run at 0.
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def set_ray_auth_mode(mode: str) -> None:
    """Run the Ray this process starts in ``mode`` ("token": Ray makes a token in
    ~/.ray/auth_token unless RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH names one). Ray reads
    RAY_AUTH_MODE into its config at import, so the config is read again, as Ray's own
    ``_enable_token_auth`` does. A driver keeps the mode of its first ``ray.init``."""
    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")


# A Ray that pdserve starts on one machine is that machine: its workers share the cores on
# purpose (more threads than cores on a small box), the OS schedules them, and pinning is a
# separate choice. There the CPU resource is bookkeeping and must never be what stops a
# placement, also for further clusters a driver starts in the same Ray (the tests run several
# in one process). On a real multi-node Ray (``ray_address``) the nodes' own counts apply.
LOCAL_RAY_MIN_CPUS = 64


def local_ray_cpus(cfg) -> int:
    """CPUs a Ray that a cluster starts announces (``cfg``: its ``ClusterConfig``): room for every
    worker it may run (each reserves its torch threads), never fewer than ``LOCAL_RAY_MIN_CPUS``
    or the machine's cores."""
    return max(os.cpu_count() or 1, LOCAL_RAY_MIN_CPUS, cfg.max_workers() * cfg.worker_threads() + 1)


def start_local_ray(num_cpus: int, token_auth: bool) -> None:
    """A new Ray instance of this process's own ("local": even when another Ray runs on this
    machine), with token authentication unless ``token_auth`` is off."""
    set_ray_auth_mode("token" if token_auth else "disabled")
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")  # read by the raylet this ray.init starts
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                     object_store_memory=256 << 20, num_cpus=num_cpus)
            return
        except RuntimeError as exc:
            # Ray waits 30 s for its GCS server to publish its port. Once, in a test run here,
            # the GCS had not even opened its log in that time, and the run's next start was
            # fine: start it again rather than fail the cluster.
            if "gcs_server_port" not in str(exc) or attempt == RAY_START_ATTEMPTS:
                raise
            log.warning("Ray's GCS server did not start (%s); starting Ray again (%d of %d)",
                        exc, attempt + 1, RAY_START_ATTEMPTS)
            ray.shutdown()

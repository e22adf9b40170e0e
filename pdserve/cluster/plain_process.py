"""What both kinds of ``pdserve worker`` process share, whichever role they serve
(``worker_cli`` for a prefill or decode worker, ``worker_router`` for the router): the engine
config and the internal plane's certificate from its typed settings, and the wait for SIGTERM.

A module of its own so that the two entry modules need nothing of each other.
"""

from __future__ import annotations

import asyncio
import os
import signal

from pdserve.cluster.mode import DISAGGREGATED
from pdserve.cluster.setting import SettingsError
from pdserve.cluster.typed_settings import DEFAULT_TPOT_OBJECTIVE_S, InternalSettings, WorkerSettings


def engine_config(s: WorkerSettings):
    """The engine's config of ``pdserve worker`` (``EngineSettings.engine_config``, as
    ``pdserve serve`` builds its pools'): a deployment's workers are a disaggregated cluster's,
    so a decode worker's local prefill is capped by default (``DISAGGREGATED_MIXED_PREFILL_TOKENS``)
    and its mixed step aims at half ``DEFAULT_TPOT_OBJECTIVE_S``, as ``pdserve serve``'s defaults.
    Its device is ``--device`` (``check_device``); under Ray there is none: placement picks the GPU.
    Only a decode worker speculates (``--speculative-config``); the router's engine config is read
    for the model's limits, and says none either."""
    return s.engine.engine_config(tensor_parallel_size=s.engine.tensor_parallel_size, mode=DISAGGREGATED,
                                  elastic_roles=False, tpot_objective_s=DEFAULT_TPOT_OBJECTIVE_S,
                                  decodes=s.role == "decode", device=check_device(s.plain.device))


def check_device(name: str | None, environ=os.environ) -> str | None:
    """``--device`` as given, once checked: ``SettingsError`` naming it for a name that is not
    cpu, cuda or cuda:N, or for a CUDA device this process cannot see."""
    if name is None:
        return None
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SettingsError(f"--device: {name!r} is not a device: cpu, cuda or cuda:N")
    if device.type == "cuda":
        count, index = torch.cuda.device_count(), device.index or 0
        if index >= count:
            visible = environ.get("CUDA_VISIBLE_DEVICES")
            raise SettingsError(f"--device: {name} asks for CUDA device {index}, but this process sees {count} "
                                f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'})")
    return name


def internal_tls(internal: InternalSettings, role: str):
    """The internal plane's certificate (``--tls-cert/--tls-key/--tls-ca``), checked to name
    ``role``; None without one."""
    from pdserve.wire import tls

    return tls.check_role(tls.load(internal.tls_cert, internal.tls_key, internal.tls_ca, prefix="tls"), role,
                          "tls_cert")


async def stop_signal() -> None:
    """Return once this process gets SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

"""The worker shell: what a prefill worker and a decode worker share, written once.

- ``worker.py``: ``WorkerShell``, the engine on its thread plus a KV-transfer agent, with the
  bridge to asyncio, abort, stats and drain; each role's ``worker.py`` subclasses it.
- ``service.py``: ``ShellRpcs``, the ``Abort`` / ``Stats`` / ``Drain`` RPCs and the admission
  check; each role's ``service.py`` mixes it in.
- ``server.py``: ``serve``, a worker's gRPC server, health and /metrics; each role's
  ``server.py`` calls it.
- ``stats.py``: the ``WorkerStats`` snapshot, read without stopping the engine thread.

It sits above ``engine`` and ``kv_transfer`` (a worker drives both) and below the two worker
packages, which import it; it imports neither of them.
"""

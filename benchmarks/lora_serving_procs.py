"""``benchmarks/lora_serving.py --processes``: the multi-LoRA cluster served as it is deployed, each
role a process of its own (``pdserve worker --role router|prefill|decode``, as Kubernetes runs
them and as benchmarks/spec_decode.py's clusters do), rather than three threads of the
benchmark's one process (tests/helpers/lora_serving.py).

Every role gets the same flags: ``--enable-lora``, the adapters as ``--lora-modules name=dir``,
``--max-loras 4``, ``--max-lora-rank``, the dtype, ``--max-num-seqs`` and one torch thread
(``--threads-per-worker 1``, what ``pdserve serve`` gives each of two workers on two cores);
the rest keeps ``pdserve worker``'s defaults. With ``step_trace_dir`` each worker writes its
steps there under its worker id (``prefill-0``, ``decode-0``), as the in-process cluster's do.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu_bench.served import Process, free_ports, members, router_healthy, wait_until

SERVED_NAME = "smollm2"


class ProcessCluster:
    """Router, prefill and decode worker as three ``pdserve worker`` processes on loopback; serving
    (both workers in the router's table, its /health 200) once the constructor returns."""

    def __init__(self, model_dir: Path | str, modules: tuple[tuple[str, str], ...], logs: Path, *, dtype: str,
                 max_lora_rank: int, max_num_seqs: int, threads: int = 1, step_trace_dir: str | None = None):
        grpc_port, http_port, admin_port = free_ports(3)
        self.http_port, admin = http_port, f"127.0.0.1:{admin_port}"
        flags = [str(model_dir), "--served-model-name", SERVED_NAME, "--internal-host", "127.0.0.1",
                 "--join-interval-seconds", "0.5", "--drain-grace-seconds", "2", "--dtype", dtype,
                 "--max-num-seqs", str(max_num_seqs), "--threads-per-worker", str(threads),
                 "--enable-lora", "--max-loras", "4", "--max-lora-rank", str(max_lora_rank),
                 "--lora-modules", *(f"{name}={path}" for name, path in modules)]
        if step_trace_dir:
            flags += ["--step-trace-dir", step_trace_dir]
        logs.mkdir(parents=True, exist_ok=True)
        self.procs = [Process("router", ["--role", "router", *flags, "--host", "127.0.0.1", "--grpc-port",
                                         str(grpc_port), "--port", str(http_port), "--internal-port", str(admin_port)],
                              logs / "router.log")]
        try:
            for role in ("prefill", "decode"):
                self.procs.append(Process(role, ["--role", role, *flags, "--router-admin", admin,
                                                 "--worker-id", f"{role}-0"], logs / f"{role}.log"))
            wait_until(lambda: all(p.address for p in self.procs), "every process to serve", self.procs)
            wait_until(lambda: members(admin) == 2, "both workers in the router's table", self.procs)
            wait_until(lambda: router_healthy(http_port), "the router's /health", self.procs)
        except BaseException:
            self.stop()
            raise

    @property
    def grpc_address(self) -> str:
        return self.procs[0].address

    def stop(self) -> None:
        """SIGTERM to each (workers first: each leaves the table and drains), then wait for all."""
        for p in self.procs[::-1]:
            p.stop()
        for p in self.procs[::-1]:
            p.wait(60)

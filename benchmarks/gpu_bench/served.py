"""Phase 3 of the GPU bench: a served 1P+1D cluster on one device, without Ray: a router, a
prefill worker and a decode worker as three plain ``pdserve worker`` processes
(pdserve/cluster/worker_cli.py), the workers joining the router on loopback, sharing the
device by the memory flags the script gives them (``--worker-flags``).

``--shape smol``: a random-weight checkpoint of SmolLM2-135M's shape, written here in
bfloat16. ``--shape 8b``: Llama-3.1-8B's config alone, served with ``--load-format dummy``
(with ``PDSERVE_BENCH_SHAPE=tiny``, the tiny Llama instead: the dry run). Both get the bench's
full-vocabulary tokenizer (tests/gpu/smol.py ``byte_tokenizer(vocab_size)``).

At each concurrency (``PDSERVE_BENCH_CONCURRENCY``) a closed loop of that many clients sends
2C + 2 streamed completions (prompt and output lengths fixed, ``ignore_eos``) through the
project's load generator (benchmarks/load): TTFT, TPOT, ITL at p50/p90/p99, and the KV
transfers of the decode worker over the level (its ``Stats``: count, bytes, and seconds a
request). Each process's log is left next to the JSON (its last 256 KiB).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_bench.common import Deadline, config_dir, device_name  # noqa: E402

PDSERVE = [sys.executable, "-c", "import sys; from pdserve.cli import main; sys.exit(main())"]
START_TIMEOUT_S = 240.0
LOG_TAIL_BYTES = 256 << 10
LEVEL_MIN_S = 20.0  # a load level is not started with less of the phase's budget left


def smol_checkpoint(directory: Path, layers: int) -> Path:
    """SmolLM2-135M's shape with random weights, as the GPU check builds it (tests/gpu/smol.py),
    saved in bfloat16, with the bench tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.gpu.smol import INIT_STD, SMOLLM2_135M, byte_tokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**SMOLLM2_135M, "num_hidden_layers": layers}, initializer_range=INIT_STD)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(directory))
    byte_tokenizer(SMOLLM2_135M["vocab_size"]).save_pretrained(str(directory))
    return directory


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Process:
    """One ``pdserve worker`` with its output copied into ``log``; ``address`` once it serves."""

    def __init__(self, name: str, args: list[str], log: Path):
        self.name, self.log = name, log
        self.address: str | None = None
        self.proc = subprocess.Popen([*PDSERVE, "worker", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                         filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))})
        threading.Thread(target=self._copy, daemon=True).start()

    def _copy(self) -> None:
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                if self.address is None and "listening on" in line:
                    self.address = line.split("listening on ")[1].split()[0].rstrip(";,")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        data = self.log.read_bytes() if self.log.exists() else b""
        if len(data) > LOG_TAIL_BYTES:
            self.log.write_bytes(data[-LOG_TAIL_BYTES:])


def wait_until(predicate, what: str, procs: list[Process], timeout_s: float = START_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited (rc {p.proc.returncode}) before {what}; see {p.log}")
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")


def router_healthy(http_port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=3).status == 200
    except OSError:
        return False


def members(admin: str) -> int:
    import grpc

    from pdserve.protos import admin_pb2, admin_pb2_grpc

    try:
        with grpc.insecure_channel(admin) as ch:
            return len(admin_pb2_grpc.RouterAdminStub(ch).GetMembership(admin_pb2.Membership(), timeout=5).members)
    except grpc.RpcError:
        return 0


def decode_stats(address: str) -> dict:
    import grpc

    from pdserve.protos import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        s = worker_pb2_grpc.DecodeWorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)
    return {"transfers": s.kv_transfers, "bytes": s.kv_transfer_bytes, "seconds": s.kv_transfer_seconds,
            "failures": s.kv_transfer_failures, "num_blocks_total": s.num_blocks_total}


def device_memory() -> list[dict]:
    """Each process's device memory as nvidia-smi reports it (none without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [{"pid": int(pid), "used": used.strip()} for pid, used in
            (line.split(",", 1) for line in out.strip().splitlines() if "," in line)]


def start_cluster(model_dir: Path, worker_flags: list[str], logs: Path, stem: str) -> tuple[list[Process], int, str]:
    """Router, prefill and decode; returns them, the router's HTTP port and the decode worker's address."""
    grpc_port, http_port, admin_port = free_ports(3)
    admin = f"127.0.0.1:{admin_port}"
    common = [str(model_dir), "--served-model-name", "bench", "--internal-host", "127.0.0.1", "--join-interval-seconds", "0.5",
              "--drain-grace-seconds", "2"]
    procs = [Process("router", ["--role", "router", *common, "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                                "--port", str(http_port), "--internal-port", str(admin_port)],
                     logs / f"{stem}_router.log")]
    for role in ("prefill", "decode"):
        # Both start at once: a share is measured as a worker starts, and workers on one device
        # take turns for that themselves (pdserve/engine/device_turn.py; the second logs its wait).
        procs.append(Process(role, ["--role", role, *common, "--router-admin", admin, "--worker-id", f"bench-{role}",
                                    *worker_flags], logs / f"{stem}_{role}.log"))
    return procs, http_port, admin


def load_level(base_url: str, concurrency: int, settings, decode: str) -> dict:
    from benchmarks.load import Arrivals, Lengths, WorkloadSpec, run

    spec = WorkloadSpec(num_requests=2 * concurrency + 2, arrivals=Arrivals("closed", concurrency=concurrency),
                        prompt_len=Lengths.fixed(settings.prompt_tokens),
                        output_len=Lengths.fixed(settings.output_tokens), token_range=(3, 259),
                        seed=concurrency, request_timeout_s=120.0)
    before = decode_stats(decode)
    results = run(spec, base_url, progress=False)
    after = decode_stats(decode)
    moved = {k: after[k] - before[k] for k in ("transfers", "bytes", "seconds", "failures")}
    summary = asdict(results.summary)
    errors = sorted({r.error for r in results.records if r.error})[:3]
    return {"concurrency": concurrency, "requests": spec.num_requests, "prompt_tokens": settings.prompt_tokens,
            "output_tokens": settings.output_tokens,
            **{k: summary[k] for k in ("completed", "failed", "duration_s", "req_s", "output_tok_s")},
            "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"], "itl_ms": summary["itl_ms"],
            "kv_transfers": moved["transfers"], "kv_transfer_failures": moved["failures"],
            "kv_bytes_per_request": round(moved["bytes"] / moved["transfers"]) if moved["transfers"] else None,
            "kv_transfer_ms_per_request": round(moved["seconds"] / moved["transfers"] * 1e3, 3)
            if moved["transfers"] else None, "errors": errors}


def run(args, settings, record) -> None:
    import torch

    from benchmarks.load.runner import json_safe

    flags = shlex.split(args.worker_flags)
    deadline = Deadline(args.budget_s)
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "smol":
            model_dir = smol_checkpoint(Path(tmp) / "smol", settings.smol_layers)
        else:
            model_dir = config_dir(Path(tmp) / f"llama-{settings.shape}", settings.hf_config)
            flags += ["--load-format", "dummy"]
        record.set(device=device_name(torch.device(settings.device)),
                   model=args.shape if args.shape == "smol" else settings.shape,
                   worker_flags=flags)
        start = time.monotonic()
        procs, http_port, admin = start_cluster(model_dir, flags, args.out.parent, args.out.stem)
        try:
            wait_until(lambda: all(p.address for p in procs), "every process to serve", procs)
            wait_until(lambda: members(admin) == 2, "both workers in the router's table", procs)
            wait_until(lambda: router_healthy(http_port), "the router's /health", procs)
            record.set(start_seconds=round(time.monotonic() - start, 1), device_memory=device_memory(),
                       kv_blocks=decode_stats(procs[2].address)["num_blocks_total"])
            for c in settings.concurrency:
                if deadline.left() < LEVEL_MIN_S:
                    record.skip({"concurrency": c}, "out of time")
                    continue
                record.add(json_safe(load_level(f"http://127.0.0.1:{http_port}", c, settings, procs[2].address)))
        finally:
            # The decode worker first, alone: a worker leaving the router's table waits while the
            # router polls the workers left, and the decode worker's leave, beside the prefill
            # worker's stop, spent seconds on its timeout. Then the prefill worker and the router
            # together (the router takes seconds to exit; the prefill worker's leave is answered
            # meanwhile).
            for group in ((procs[2],), (procs[1], procs[0])):
                for p in group:
                    p.stop()
                for p in group:
                    p.wait(60)


if __name__ == "__main__":
    from benchmarks.gpu_bench.common import phase_main

    sys.exit(phase_main(run))

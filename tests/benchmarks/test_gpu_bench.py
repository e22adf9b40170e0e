"""The GPU bench (scripts/gpu_bench.sh, issue 54), proved here on the CPU: every phase dry-runs
with the tiny shapes and writes well-formed JSON; a phase that hangs or fails is settled with its
error and the next phase still runs; and what its served cluster imports is either on the lent
host or in `make gpu-bundle`'s wheels."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_bench.common import BenchSettingError, BenchSettings
from benchmarks.gpu_bench.outcome import settle

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bundle  # noqa: E402

SCRIPT = ROOT / "scripts/gpu_bench.sh"
# Of this host's RAM: about 1 GiB a worker (0.043 of 24 GiB here), of which about 0.55 GiB is its
# weights and a step, the rest its KV cache (a bigger cache only costs its start more seconds).
SHARE = math.ceil(1000 * (1 << 30) / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))) / 1000
# The dry run's cuts: the tiny Llama for the 8B shape, a 2-layer SmolLM2, small batches,
# contexts, reads and loads; one thread a worker on this shared box.
DRY_RUN = {"PDSERVE_BENCH_DEVICE": "cpu", "PDSERVE_BENCH_SHAPE": "tiny", "PDSERVE_BENCH_BATCHES": "1 2",
           "PDSERVE_BENCH_CONTEXTS": "32 64", "PDSERVE_BENCH_PREFILL": "16 32", "PDSERVE_BENCH_NIXL_BLOCKS": "4 16",
           "PDSERVE_BENCH_BY_HEAD_BLOCKS": "4",
           "PDSERVE_BENCH_CONCURRENCY": "1 2", "PDSERVE_BENCH_PROMPT_TOKENS": "32", "PDSERVE_BENCH_OUTPUT_TOKENS": "8",
           "PDSERVE_BENCH_SMOL_LAYERS": "2", "PDSERVE_THREADS_PER_WORKER": "1",
           # The 135M-shaped cluster's two workers take a share of the host's RAM each, the CPU
           # stand-in for two workers sharing one GPU; the 8B-shaped one an exact cache.
           "PDSERVE_BENCH_MEMORY_FLAGS_SMOL": f"--gpu-memory-utilization {SHARE}",
           "PDSERVE_BENCH_MEMORY_FLAGS_8B": "--kv-cache-gib 0.0625",
           # limits far above the dry run's needs (about 15-60 s a phase), so a loaded box skips nothing
           **{f"PDSERVE_BENCH_LIMIT_{p}": "300" for p in ("ENGINE", "NIXL", "SERVED_SMOL", "SERVED_8B")}}


def bench(out: Path, tmp: Path, python: str = sys.executable, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **DRY_RUN, "OUT": str(out), "GPU_BUNDLE": str(tmp / "no-bundle"), "PYTHON": python, **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_every_phase_dry_runs_on_the_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "out"
    run = bench(out, tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert len(re.findall(r"== phase \d/4 \w+: ok in", run.stdout)) == 4, run.stdout
    docs = {name: json.loads((out / f"{name}.json").read_text())
            for name in ("engine_8b", "nixl_vram", "served_smol", "served_8b")}
    for name, doc in docs.items():
        assert doc["status"] == "ok" and doc["error"] is None and doc["exit_status"] == 0, (name, doc)
        assert doc["phase"] == name and doc["device"] == "cpu", doc
    engine = docs["engine_8b"]["rows"]
    (load,) = [r for r in engine if r["what"] == "load"]
    assert load["weight_bytes"] > 0 and load["seconds"] > 0
    decode = [r for r in engine if r["what"] == "decode" and "skipped" not in r]
    assert {(r["batch"], r["context"]) for r in decode} == {(1, 32), (2, 32), (1, 64), (2, 64)}
    assert all(r["running"] == r["batch"] and r["ms_per_step"] > 0 and r["floor_ms_measured_bw"] > 0 for r in decode)
    assert all(r["kv_bytes_read"] > 0 for r in decode)
    assert [r["skipped"] for r in engine if "skipped" in r] == ["CUDA graphs need CUDA"]
    assert [r["tokens"] for r in engine if r["what"] == "prefill"] == [16, 32]
    (mixed,) = [r for r in engine if r["what"] == "mixed"]  # 32 streams and a 256-token chunk, eagerly here
    assert (mixed["rows"], mixed["chunk"], mixed["cuda_graphs"], mixed["piecewise"]) == (32, 256, False, False)
    assert mixed["ms"] > 0
    # The smallest shape's step is profiled: torch's operators on the CPU, the linears among them.
    (profile,) = [r for r in engine if r["what"] == "step_profile"]
    assert (profile["batch"], profile["context"]) == (1, 32) and profile["kernels_per_step"] > 0
    assert profile["device_busy_ms"] == pytest.approx(sum(profile["ms_by_class"].values()), abs=0.01)
    assert "linear" in profile["ms_by_class"] and profile["top_kernels"]
    reads = docs["nixl_vram"]["rows"]
    assert {(r["blocks"], r["layout"]) for r in reads} == {(4, "in_order"), (4, "scattered"), (16, "in_order"),
                                                          (16, "scattered"), (4, "by_head_1:1"), (4, "by_head_2:1"),
                                                          (4, "by_head_1:2")}
    assert all(r["bytes_equal"] and r["gb_per_s_median"] > 0 and r["us_per_descriptor"] > 0 for r in reads)
    for name in ("served_smol", "served_8b"):
        rows = docs[name]["rows"]
        assert [r["concurrency"] for r in rows] == [1, 2], rows
        for r in rows:
            assert r["completed"] == r["requests"] and r["failed"] == 0, r
            assert r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p99"] > 0 and r["itl_ms"]["p50"] > 0, r
            # every measured request's KV crossed over (plus the load generator's warm-up request)
            assert r["kv_transfers"] == r["requests"] + 1 and r["kv_transfer_failures"] == 0, r
            assert r["kv_transfer_ms_per_request"] > 0 and r["kv_bytes_per_request"] > 0, r
        assert (out / f"{name}_decode.log").stat().st_size > 0
    assert "--load-format" in docs["served_8b"]["worker_flags"]
    for role in ("prefill", "decode"):  # each sized its cache from its share, started together (device_turn)
        assert f"gpu_memory_utilization {SHARE:g} of host RAM" in (out / f"served_smol_{role}.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["phases"].values()) == {"ok"}
    assert set(summary["targets"]) == {"decode_b1_graphed_over_floor", "decode_b1_graphed_over_measured_floor",
                                       "prefill_2k_mfu", "mixed_step_graphed_over_eager", "nixl_in_order_gb_per_s",
                                       "nixl_by_head_2to1_over_same_tp"}
    assert summary["targets"]["nixl_by_head_2to1_over_same_tp"]["value"] > 0


def test_a_phase_that_hangs_or_fails_is_settled_with_its_error_and_the_next_phase_runs(tmp_path):
    """A stand-in interpreter: the engine phase hangs past its 2 s limit, the NIXL phase fails;
    the script's own steps (settling each JSON, the summary) run on the real one."""
    stand_in = tmp_path / "python"
    stand_in.write_text(f"""#!/bin/sh
case "$*" in
  *gpu_bench.engine_8b*) echo measuring; sleep 60 ;;
  *gpu_bench.nixl_vram*) echo "NIXL exploded" >&2; exit 3 ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    run = bench(out, tmp_path, python=str(stand_in), PDSERVE_BENCH_PHASES="1 2", PDSERVE_BENCH_LIMIT_ENGINE="2")
    assert run.returncode == 1, run.stdout + run.stderr
    engine = json.loads((out / "engine_8b.json").read_text())
    assert engine["status"] == "timeout" and engine["exit_status"] in (124, 137), engine
    assert "timed out" in engine["error"] and "measuring" in engine["error"], engine
    nixl = json.loads((out / "nixl_vram.json").read_text())
    assert nixl["status"] == "failed" and nixl["exit_status"] == 3 and "NIXL exploded" in nixl["error"], nixl
    assert not (out / "served_smol.json").exists()  # not asked for
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"] == {"engine_8b": "timeout", "nixl_vram": "failed", "served_smol": "missing",
                                 "served_8b": "missing"}
    assert "== phase 1/4 engine_8b: timeout in" in run.stdout and "== phase 2/4 nixl_vram: failed in" in run.stdout


def test_settling_keeps_the_rows_and_judges_by_the_exit_status():
    rows = [{"what": "load", "seconds": 1.0}]
    cut = settle({"phase": "p", "status": "running", "rows": rows, "error": None}, "p", 124, 9, "last line")
    assert cut["status"] == "timeout" and cut["rows"] == rows and "last line" in cut["error"]
    assert settle({"phase": "p", "status": "ok", "rows": rows, "error": None}, "p", 0, 9, "")["status"] == "ok"
    unfinished = settle({"phase": "p", "status": "running", "rows": [], "error": None}, "p", 0, 9, "")
    assert unfinished["status"] == "failed"
    died = settle(None, "p", 2, 1, "PDSERVE_BENCH_BATCHES: expected whole numbers")
    assert died["phase"] == "p" and died["status"] == "failed" and "PDSERVE_BENCH_BATCHES" in died["error"]


def test_a_finished_engine_lets_its_kv_cache_go_before_the_next_one_is_built(tmp_path):
    """The bench builds a graphed engine, then an eager one, on one model: the model's attention
    layers hold the cache views they were last bound to, so without ``release`` the first
    engine's cache (64 GiB at batch 64 and 8k) would stay beside the second's."""
    import gc
    import weakref

    import torch

    from benchmarks.gpu_bench import engine_8b
    from benchmarks.gpu_bench.common import TINY_LLAMA, config_dir
    from pdserve.engine.loader import load_model

    settings = BenchSettings.from_environ({**DRY_RUN, "PDSERVE_BENCH_PREFILL": "16"})
    model_dir = config_dir(tmp_path / "tiny", TINY_LLAMA, tokenizer=False)
    model, cfg, _ = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"), progress=False, load_format="dummy")
    engine = engine_8b.engine_for(model, cfg, model_dir, torch.device("cpu"), 32, False, settings)
    (row,) = engine_8b.decode_row(engine, 2, 32, torch.device("cpu"), None, 10.0, 1000)
    assert row["running"] == 2 and row["ms_per_step"] > 0
    cache = weakref.ref(engine.kv_cache)
    engine_8b.release(engine, model)
    del engine
    gc.collect()
    assert cache() is None


def test_the_summary_judges_each_target_on_its_own_row():
    from benchmarks.gpu_bench.report import targets

    decode = [{"what": "decode", "batch": 1, "cuda_graphs": True, "context": c, "step_over_floor": f,
               "ms_per_step": ms, "floor_ms_measured_bw": 4.0}
              for c, f, ms in ((8192, 1.1, 9.0), (1024, 1.5, 5.0))] + [
        {"what": "decode", "batch": 1, "cuda_graphs": False, "context": 1024, "step_over_floor": 1.0,
         "ms_per_step": 4.0, "floor_ms_measured_bw": 4.0}]
    docs = {"engine_8b": {"rows": [*decode, {"what": "prefill", "tokens": 2048, "mfu": 0.45},
                                   {"what": "mixed", "cuda_graphs": True, "piecewise": True, "ms": 12.0},
                                   {"what": "mixed", "cuda_graphs": False, "piecewise": False, "ms": 30.0},
                                   {"what": "prefill", "tokens": 8192, "skipped": "out of time"}]},
            "nixl_vram": {"rows": [{"layout": "in_order", "gb_per_s_median": 120.0},
                                   {"layout": "scattered", "gb_per_s_median": 300.0},
                                   {"layout": "by_head_1:1", "gb_per_s_median": 40.0},
                                   {"layout": "by_head_2:1", "gb_per_s_median": 18.0}]}}
    got = targets(docs)
    assert got["decode_b1_graphed_over_floor"] == {"value": 1.5, "target": "at most 1.3", "met": False}
    assert got["decode_b1_graphed_over_measured_floor"] == {"value": 1.25, "target": "at most 1.3", "met": True}
    assert got["prefill_2k_mfu"]["met"] is True and got["nixl_in_order_gb_per_s"]["value"] == 120.0
    assert got["nixl_by_head_2to1_over_same_tp"] == {"value": 0.45, "target": "at least 0.5", "met": False}
    assert got["mixed_step_graphed_over_eager"] == {"value": 0.4, "target": "at most 1", "met": True}
    assert {t["met"] for t in targets({}).values()} == {None}  # nothing measured: nothing judged


@pytest.mark.parametrize("name, value", [("PDSERVE_BENCH_BATCHES", "1 x"), ("PDSERVE_BENCH_CONTEXTS", "0"),
                                         ("PDSERVE_BENCH_DEVICE", "tpu"), ("PDSERVE_BENCH_SHAPE", "70b")])
def test_a_bad_setting_is_refused_naming_it(name, value):
    with pytest.raises(BenchSettingError, match=name):
        BenchSettings.from_environ({name: value})


# Imported by code on the bench's path only under settings it never gives: TLS certificates
# (cryptography), an OTLP endpoint (opentelemetry), and Ray's placement (ray).
NOT_ON_THE_BENCH_PATH = {"cryptography", "opentelemetry", "ray"}
# What the lent host has (gpu_bundle's docstring): these and their own requirements.
HOST_HAS = ("torch", "numpy", "transformers", "tokenizers", "safetensors", "huggingface_hub", "pytest", "grpcio",
            "xxhash")
ENTRY_POINTS = ("pdserve.cluster.worker_cli", "pdserve.cluster.worker_router", "pdserve.router.server",
                "pdserve.router.http_api", "pdserve.prefill_worker.server", "pdserve.decode_worker.server",
                "benchmarks.gpu_bench.engine_8b", "benchmarks.gpu_bench.nixl_vram", "benchmarks.gpu_bench.served",
                "benchmarks.gpu_bench.report", "benchmarks.load")


def _with_requirements(names) -> set[str]:
    """``names`` and every distribution they require (extras left out), as installed here."""
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    seen, todo = set(), [norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [norm(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0]) for r in requires if "extra ==" not in r]
    return seen


@pytest.mark.slow
def test_what_the_served_cluster_imports_is_on_the_host_or_in_the_bundle():
    """Every third-party import statement (at the top or inside a function) of every pdserve and
    benchmarks module that the workers, the router and the bench's phases load."""
    probe = f"""
import ast, importlib, json, sys
for m in {ENTRY_POINTS!r}:
    importlib.import_module(m)
tops = set()
for name, mod in list(sys.modules.items()):
    if name.split(".")[0] in ("pdserve", "benchmarks") and getattr(mod, "__file__", None):
        for node in ast.walk(ast.parse(open(mod.__file__).read())):
            if isinstance(node, ast.Import):
                tops |= {{a.name.split(".")[0] for a in node.names}}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
print(json.dumps(sorted(t for t in tops if t not in sys.stdlib_module_names)))
"""
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    imported = set(json.loads(found.stdout.splitlines()[-1])) - {"pdserve", "benchmarks", "tests"}
    allowed = _with_requirements(HOST_HAS) | _with_requirements(
        re.split(r"[=<>]", spec)[0] for spec in gpu_bundle.GPU_WHEELS)
    providers = md.packages_distributions()
    missing = {top: providers.get(top) for top in imported - NOT_ON_THE_BENCH_PATH
               if not any(re.sub(r"[-_.]+", "-", d).lower() in allowed for d in providers.get(top, [top]))}
    assert not missing, f"imported on the bench's path, neither on the host nor in gpu_bundle.GPU_WHEELS: {missing}"
    assert {"aiohttp", "prometheus_client", "grpc_reflection"} <= imported  # the probe sees the served path

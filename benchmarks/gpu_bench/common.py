"""What every phase of the GPU bench shares: the model shapes, the settings (``PDSERVE_BENCH_*``
variables, read once), the device's spec sheet, a model directory built on the spot, and the
phase's JSON record, rewritten after every row."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Llama-3.1-8B's config.json, less its weights. BOS and EOS are the bench tokenizer's ids
# (tests/gpu/smol.py ``byte_tokenizer`` with a piece for every id), not Meta's, so the router
# and the engine agree on them.
LLAMA_31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16",
)
# The same family cut to a size the CPU dry run loads in a moment (PDSERVE_BENCH_SHAPE=tiny).
TINY_LLAMA = {**LLAMA_31_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
              "rope_scaling": None}
SHAPES = {"8b": LLAMA_31_8B, "tiny": TINY_LLAMA}
BLOCK_SIZE = 16  # pdserve's default block: 2 MiB of KV a block at the 8B shape


class BenchSettingError(ValueError):
    """A ``PDSERVE_BENCH_*`` variable that cannot be used, named with what it takes."""


def _ints(environ, name: str, default: str) -> tuple[int, ...]:
    text = environ.get(name, default)
    try:
        values = tuple(int(v) for v in text.split())
    except ValueError:
        raise BenchSettingError(f"{name}: expected whole numbers separated by spaces, got {text!r}") from None
    if not values or min(values) < 1:
        raise BenchSettingError(f"{name}: expected at least one number, each >= 1, got {text!r}")
    return values


@dataclass(frozen=True)
class BenchSettings:
    """Everything the phases vary, from ``PDSERVE_BENCH_*`` (defaults: the issue's sizes)."""

    device: str  # PDSERVE_BENCH_DEVICE: cuda (default) or cpu, the dry run
    shape: str  # PDSERVE_BENCH_SHAPE: 8b (default) or tiny
    batches: tuple[int, ...]  # decode batch sizes
    contexts: tuple[int, ...]  # decode context lengths, tokens
    prefill_tokens: tuple[int, ...]
    nixl_blocks: tuple[int, ...]  # blocks a read moves
    by_head_blocks: int  # blocks a read by head moves (1 MiB each, all ranks)
    concurrency: tuple[int, ...]  # closed-loop clients of the served cluster
    prompt_tokens: int  # each served request's prompt
    output_tokens: int  # and its output
    smol_layers: int  # layers of the SmolLM2-shaped served model (30: SmolLM2's own)

    @classmethod
    def from_environ(cls, environ=None) -> "BenchSettings":
        env = os.environ if environ is None else environ
        device, shape = env.get("PDSERVE_BENCH_DEVICE", "cuda"), env.get("PDSERVE_BENCH_SHAPE", "8b")
        if device not in ("cuda", "cpu"):
            raise BenchSettingError(f"PDSERVE_BENCH_DEVICE: cuda or cpu, got {device!r}")
        if shape not in SHAPES:
            raise BenchSettingError(f"PDSERVE_BENCH_SHAPE: one of {sorted(SHAPES)}, got {shape!r}")
        return cls(device=device, shape=shape,
                   batches=_ints(env, "PDSERVE_BENCH_BATCHES", "1 8 64"),
                   contexts=_ints(env, "PDSERVE_BENCH_CONTEXTS", "1024 8192"),
                   prefill_tokens=_ints(env, "PDSERVE_BENCH_PREFILL", "512 2048 8192"),
                   nixl_blocks=_ints(env, "PDSERVE_BENCH_NIXL_BLOCKS", "16 128 512"),
                   by_head_blocks=_ints(env, "PDSERVE_BENCH_BY_HEAD_BLOCKS", "128")[0],
                   concurrency=_ints(env, "PDSERVE_BENCH_CONCURRENCY", "1 8 32"),
                   prompt_tokens=_ints(env, "PDSERVE_BENCH_PROMPT_TOKENS", "512")[0],
                   output_tokens=_ints(env, "PDSERVE_BENCH_OUTPUT_TOKENS", "64")[0],
                   smol_layers=_ints(env, "PDSERVE_BENCH_SMOL_LAYERS", "30")[0])

    @property
    def hf_config(self) -> dict:
        return SHAPES[self.shape]


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class DeviceSpec:
    """A device's datasheet figures (pdserve/planner/hardware.py), matched by its name."""

    profile: str
    bf16_flops: float  # dense, per second
    hbm_bytes_per_s: float


def device_spec(name: str) -> DeviceSpec | None:
    """The datasheet of the first profile whose name is in ``name`` ("NVIDIA H200" -> H200);
    None for a device without one (the CPU). The SXM figures: a PCIe card reaches less."""
    from pdserve.planner.hardware import GPU_PROFILES

    for key, profile in GPU_PROFILES.items():
        if key in name.upper():
            return DeviceSpec(key, profile.peak_flops, profile.peak_mem_bw)
    return None


def read_gbs(device) -> float:
    """Best-of-5 read bandwidth measured here: a sum over 1 GiB (64 MiB on the CPU), far
    larger than any cache."""
    import torch

    x = torch.ones((256 if device.type == "cuda" else 16) << 20, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(6):
        synchronize(device)
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def config_dir(directory: Path, hf_config: dict, tokenizer: bool = True) -> Path:
    """A model directory of config.json alone (what ``--load-format dummy`` reads), and the
    bench tokenizer when the model is served."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=1))
    if tokenizer:
        from tests.gpu.smol import byte_tokenizer

        byte_tokenizer(hf_config["vocab_size"]).save_pretrained(str(directory))
    return directory


class PhaseRecord:
    """A phase's JSON at ``path``: ``status`` (running, then ok; scripts/gpu_bench.sh marks
    failed or timeout), ``device``, ``config``, ``rows`` (one a measurement or skip), and
    ``error``. Written again, whole, after every row (a new file moved over the old one, so a
    phase killed mid-write leaves the previous version)."""

    def __init__(self, path: Path, phase: str, config: dict):
        self.path = path
        self.doc = {"phase": phase, "status": "running", "device": None, "config": config, "rows": [],
                    "error": None, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._start = time.monotonic()
        self.write()

    def write(self) -> None:
        self.doc["seconds"] = round(time.monotonic() - self._start, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.path)

    def set(self, **fields) -> None:
        self.doc.update(fields)
        self.write()

    def add(self, row: dict) -> None:
        self.doc["rows"].append(row)
        self.write()
        print(f"  {self.doc['phase']}: {json.dumps(row)}", flush=True)

    def skip(self, what: dict, reason: str) -> None:
        self.add({**what, "skipped": reason})


class Deadline:
    """The phase's own time budget (``--budget-s``, a little under its timeout): a measurement
    that would start after it is recorded as skipped instead of being cut by the timeout."""

    def __init__(self, budget_s: float):
        self.end = time.monotonic() + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()


def phase_main(run) -> int:
    """Run one phase, ``run(args, settings, record)``, from the command line: ``--out FILE``
    and ``--budget-s``. SIGTERM (the script's timeout) ends it through ``finally`` blocks, so
    servers it started are stopped; an exception is written into the JSON."""
    import argparse
    import traceback

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--shape", choices=("smol", "8b"), default="8b", help="the served model (served phase)")
    ap.add_argument("--worker-flags", default="", help="flags every served worker gets (served phase)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        settings = BenchSettings.from_environ()
    except BenchSettingError as exc:
        print(f"gpu bench: {exc}", file=sys.stderr)
        return 2
    record = PhaseRecord(args.out, args.out.stem, {"settings": settings.__dict__, "budget_s": args.budget_s})
    try:
        run(args, settings, record)
    except Exception as exc:  # the phase's error goes into its JSON; the script runs the next phase
        record.set(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        traceback.print_exc()
        return 1
    record.set(status="ok")
    return 0

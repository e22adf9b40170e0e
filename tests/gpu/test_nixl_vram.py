"""NIXL VRAM-to-VRAM (part 5 of scripts/gpu_check.sh): a holder process owns a cache of the
SmolLM2-shaped model's block layout on the device, filled from a seed; this process owns
another and reads every block of it through pdserve's NIXL agent, compares the bytes, and
records the read's GB/s and the UCX transports that carried it (UCX prints its protocol
choices under ``UCX_PROTO_INFO=y``) in ``$GPU_CHECK_OUT/nixl.json``: once as pdserve sets UCX
up (cuda_ipc GETs enabled, pdserve/kv_transfer/nixl_backend.py ``ucx_settings``) and once with
UCX's own default for them (``auto``: only over NVLink), which the first H100 run measured.

With ``PDSERVE_CHECK_DEVICE=cpu`` the same read runs DRAM to DRAM (a dry run of the check)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.smol import SMOLLM2_135M, holder_context

pytestmark = pytest.mark.cuda

BLOCK_SIZE = 16
_CTX = holder_context()  # spawn on CUDA: fork would share CUDA and UCX state with the child


def _block_shape() -> tuple[int, ...]:
    layers = int(os.environ.get("PDSERVE_CHECK_LAYERS", SMOLLM2_135M["num_hidden_layers"]))
    kv_heads = SMOLLM2_135M["num_key_value_heads"]
    head_dim = SMOLLM2_135M["hidden_size"] // SMOLLM2_135M["num_attention_heads"]
    return (layers, 2, BLOCK_SIZE, kv_heads, head_dim)


def _cache(device: torch.device, num_blocks: int, seed: int | None) -> torch.Tensor:
    shape = (num_blocks, *_block_shape())
    if seed is None:
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)


def _holder(conn, device: str, num_blocks: int, seed: int) -> None:
    from pdserve.kv_transfer import create_agent

    agent = create_agent("nixl", "vram-holder", _cache(torch.device(device), num_blocks, seed))
    conn.send(agent.local_metadata().SerializeToString())
    conn.recv()  # "stop"
    agent.close()


def _transports(text: str) -> list[str]:
    """UCX_PROTO_INFO's table lines, less their timestamps, CUDA transports first: each names an
    operation (the table's header row) or a size range and the transport/device that serves it."""
    rows = [re.sub(r"^\[[^]]*\]\s*\[[^]]*\]\s*", "", ln).strip() for ln in text.splitlines() if "|" in ln]
    rows = list(dict.fromkeys(r for r in rows if r.strip("|+- ")))
    return sorted(rows, key=lambda r: "cuda" not in r)[:40]


def _record(row: dict) -> None:
    out = Path(os.environ.get("GPU_CHECK_OUT", "gpu_check_out"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "nixl.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if r["ucx_get_zcopy"] != row["ucx_get_zcopy"]] + [row]
    path.write_text(json.dumps(rows, indent=1))
    print(f"\nnixl read: { {k: v for k, v in row.items() if k != 'ucx_protocols'} }")


@pytest.mark.parametrize("get_zcopy", ["pdserve", "auto"])
def test_vram_to_vram_read_of_every_block(device, capfd, monkeypatch, get_zcopy):
    from pdserve.kv_transfer import TransferState, create_agent
    from pdserve.protos import kv_transfer_pb2

    monkeypatch.setenv("UCX_PROTO_INFO", "y")  # inherited by the holder, read by this process's UCX
    if get_zcopy == "auto":  # as an operator would set it; pdserve leaves an operator's setting be
        monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto")
    num_blocks = 1024 if device.type == "cuda" else 32
    parent, child = _CTX.Pipe()
    holder = _CTX.Process(target=_holder, args=(child, str(device), num_blocks, 1234), daemon=True)
    holder.start()
    reader = None
    try:
        assert parent.poll(120), "the holder did not publish its metadata within 120 s"
        metadata = kv_transfer_pb2.AgentMetadata.FromString(parent.recv())
        reader = create_agent("nixl", "vram-reader", _cache(device, num_blocks, None), read_timeout_s=60)
        peer = reader.add_remote(metadata)
        blocks = list(range(num_blocks))
        warm = reader.start_read(peer, blocks[:1], blocks[:1], b"warm")  # connection wire-up, not timed
        assert reader.wait(warm, timeout_s=60) == TransferState.DONE, warm.error
        start = time.perf_counter()
        handle = reader.start_read(peer, blocks, blocks[::-1], b"all")  # reversed: no accidental identity
        assert reader.wait(handle, timeout_s=120) == TransferState.DONE, handle.error
        seconds = time.perf_counter() - start
        expected = _cache(device, num_blocks, 1234)
        same = torch.equal(reader.cache.view(torch.uint8)[blocks[::-1]], expected.view(torch.uint8)[blocks])
        nbytes = reader.cache.numel() * reader.cache.element_size()
        protocols = _transports(capfd.readouterr().out + capfd.readouterr().err)
        _record({"ucx_get_zcopy": get_zcopy,
                 "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "blocks": num_blocks, "block_bytes": nbytes // num_blocks, "bytes": nbytes,
                 "seconds": round(seconds, 6), "gb_per_s": round(nbytes / seconds / 1e9, 2),
                 "bytes_equal": same, "ucx_protocols": protocols})
        assert same, "the bytes read differ from the holder's"
    finally:
        if reader is not None:
            reader.close()
        parent.send("stop")
        holder.join(30)
        if holder.is_alive():
            holder.kill()

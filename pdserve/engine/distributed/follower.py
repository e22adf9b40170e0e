"""A rank other than 0 of a tensor-parallel worker: ``python -m pdserve.engine.distributed.follower SPEC``.

Rank 0 (``pdserve.engine.distributed.group``) starts it with a ``FollowerSpec`` (JSON). It joins the
worker's process group, loads its share of the model (where a share of memory sizes the KV
cache, it measures its use with the other ranks then: pdserve/engine/distributed/memory_share.py),
maps its part of the shared KV cache (CPU) or allocates its own (CUDA), says it is loaded, then follows: each step it receives the
prepared inputs from rank 0 (``pdserve.engine.distributed.step``) and runs the same forward on its share,
then computes its vocabulary slice of the logits of the rows rank 0 computes logits for (the
sampled rows, then any rows rank 0 names), each gathered to rank 0, which alone samples. With
CUDA graphs it builds the same graphs as rank 0, when rank 0 does, and replays the one rank 0
names on rank 0's padded inputs (pdserve/engine/cuda_graphs.py). It
knows no request, block manager or scheduler. With LoRA (``FollowerSpec.max_loras``), it
mirrors rank 0's adapters and slots (pdserve/engine/lora/mirror.py): the loads and unloads
rank 0 hands on, and each step's slots.

Its service (``main``'s ``service``: what a layer above runs in this process next to the
steps; ``pdserve.shell.rank_follower``'s serves this rank's KV-transfer agent) gets this rank's
cache and its end of the socket pair with rank 0 (``FollowerSpec.service_fd``), on a thread of
its own, once the model is loaded and before rank 0 hears so.

It ends when rank 0 says stop, when its stdin (a pipe only rank 0 holds) closes because rank 0
is gone, or when a collective fails; any error ends the process, which rank 0 notices.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
from typing import Callable

import torch

from pdserve.engine.distributed import memory_share, step as tp_step
from pdserve.engine.attention.select import select_attention
from pdserve.engine.config import DTYPES
from pdserve.engine.attention.kv_cache import cache_spec_of, map_caches, prefault
from pdserve.engine.loader import load_model
from pdserve.engine.lora.mirror import LoRAMirror
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.distributed.group import FollowerSpec, join, open_store, rank_device

# A service: (this rank's spec, its KV cache, its socket to rank 0) -> runs until the socket closes.
Service = Callable[[FollowerSpec, torch.Tensor, socket.socket], None]

log = logging.getLogger(__name__)


def _exit_with_rank_0() -> None:
    """Block on stdin until rank 0's end of the pipe closes (rank 0 is gone), then exit."""
    while os.read(0, 4096):
        pass
    os._exit(0)


def _cache(spec: FollowerSpec, model: CausalLM, device: torch.device) -> torch.Tensor:
    """This rank's KV cache: its part of rank 0's shared file (CPU), or its own (CUDA)."""
    kv = cache_spec_of(model.cfg, spec.block_size, DTYPES[spec.dtype], spec.size)
    if spec.cache_fd < 0:
        return kv.allocate(spec.num_blocks, device)
    cache = map_caches(spec.cache_fd, kv, spec.num_blocks, spec.size)[spec.rank]
    os.close(spec.cache_fd)
    prefault(cache)
    return cache


def follow(group, model: CausalLM, layer_caches: list, backend, device: torch.device,
           lora: LoRAMirror | None = None) -> int:
    """Run rank 0's steps, and its logits over each step's rows, until it says stop; returns
    how many steps ran. ``lora``: this rank's mirror of rank 0's adapters (None: no LoRA)."""
    steps, hidden, graphs = 0, None, None
    with torch.inference_mode():
        while (msg := tp_step.receive(group, device)) is not None:
            if isinstance(msg, tp_step.LogitsRows):
                model.compute_logits(hidden[msg.start:msg.stop])  # this rank's slice, gathered to rank 0
                continue
            if isinstance(msg, (tp_step.LoRALoad, tp_step.LoRAUnload)):
                _update_lora(lora, msg)
                continue
            model.bind_caches(layer_caches, backend)
            if isinstance(msg, tp_step.Graphs):
                graphs = DecodeGraphs(lambda ids, pos, ctx: model.compute_logits(model(ids, pos, ctx)), msg.sizes,
                                      msg.width, msg.block_size, device, msg.capture)
                continue
            if lora is not None:
                lora.begin_step(msg.lora if isinstance(msg, tp_step.Step) else None)  # graphs hold no adapter
            if isinstance(msg, tp_step.GraphStep):
                graphs.replay_inputs(msg.size, msg.inputs)
                steps += 1
                continue
            hidden = model(msg.input_ids, msg.positions, msg.ctx)
            if msg.sample_rows.numel():
                model.compute_logits(hidden[msg.sample_rows])
            steps += 1
    return steps


def _update_lora(lora: LoRAMirror | None, msg) -> None:
    if lora is None:
        raise RuntimeError("rank 0 hands on a LoRA adapter, but this rank was started without LoRA")
    if isinstance(msg, tp_step.LoRALoad):
        lora.load(msg.adapter_id, msg.path)
    else:
        lora.unload(msg.adapter_id)


def _start(service: Service | None, spec: FollowerSpec, cache: torch.Tensor) -> None:
    """Run ``service`` on a thread of its own, over this rank's socket to rank 0 (closed here
    when there is none to run)."""
    if spec.service_fd < 0:
        return
    sock = socket.socket(fileno=spec.service_fd)
    if service is None:
        sock.close()
        return
    threading.Thread(target=service, args=(spec, cache, sock), name=f"rank{spec.rank}-service", daemon=True).start()


def main(argv: list[str], service: Service | None = None) -> int:
    spec = FollowerSpec.from_json(argv[1])
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s tp-rank{spec.rank} %(name)s %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_rank_0, name="rank0-watch", daemon=True).start()
    torch.set_num_threads(spec.threads)
    device = rank_device(torch.device(spec.device), spec.rank, spec.size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.isa is not None:
        from pdserve.engine.kernels import cpu_kernels

        cpu_kernels.load()
        cpu_kernels.set_isa(spec.isa)
    store = open_store(spec.store, spec.size)
    group = join(store, spec.rank, spec.size, device)
    tp = TensorParallel(spec.rank, spec.size, group)
    # A cache sized by a share: this rank's device read before its weights load (memory_share.py).
    probe = memory_share.rank_probe(spec.memory_share, device, spec.size) if spec.memory_share else None
    model, cfg, _ = load_model(spec.model_dir, DTYPES[spec.dtype], device, progress=False, tp=tp,
                               load_format=spec.load_format)
    if probe is not None:
        spec = dataclasses.replace(spec, num_blocks=memory_share.size_on_follower(spec, group, model, cfg, probe, device))
    cache = _cache(spec, model, device)
    backend = select_attention(spec.attention_backend, cfg, tp, device, spec.block_size, DTYPES[spec.dtype])
    layer_caches = cache_spec_of(cfg, spec.block_size, DTYPES[spec.dtype], spec.size).layer_caches(cache)
    lora = LoRAMirror(model, spec.max_loras, spec.max_lora_rank, DTYPES[spec.dtype], device) if spec.max_loras else None
    _start(service, spec, cache)
    store.set(f"loaded/{spec.rank}", "1")
    steps = follow(group, model, layer_caches, backend, device, lora)
    log.debug("rank %d stops after %d steps", spec.rank, steps)
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    logging.shutdown()
    os._exit(code)  # not the interpreter's teardown: the process group's threads may still run

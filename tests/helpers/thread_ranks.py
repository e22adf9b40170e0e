"""Two tensor-parallel ranks in one process, a thread each, for the families' TP tests
(tests/engine/test_qwen3_tp.py, test_phi3.py, test_granite.py): ``ThreadGroup`` stands in for
the gloo group, and ``run_ranks`` generates with every rank's share of a model directory."""

import threading

import torch
from safetensors.torch import load_file

from pdserve.engine.attention.base import SdpaAttention, build_context
from pdserve.engine.attention.kv_cache import KVCacheSpec, layer_views
from pdserve.engine.loader import read_model_config
from pdserve.engine.models.registry import build_model
from pdserve.engine.parallel import TensorParallel

BLOCK, NUM_BLOCKS, NEW_TOKENS = 16, 16, 6


class ThreadGroup:
    """A stand-in for a gloo process group of ``size`` ranks, one thread per rank."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=120)
        self.parts: list[torch.Tensor | None] = [None] * size
        self.token: int | None = None  # rank 0's latest, for the others (the runtime broadcasts it)

    def next_token(self, rank: int, logits: torch.Tensor | None) -> int:
        """Rank 0 alone has the whole logits and samples; every rank takes its token as its next input."""
        if rank == 0:
            self.token = int(logits.argmax())
        self.barrier.wait()
        token = self.token
        self.barrier.wait()  # every rank has it before rank 0 writes the next one
        return token

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = x.clone()
        self.barrier.wait()  # every rank's part is in
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        self.barrier.wait()  # every rank has read the parts before any writes its next one
        return x.copy_(total)

    def gather(self, rank: int, x: torch.Tensor) -> list[torch.Tensor] | None:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.parts) if rank == 0 else None
        self.barrier.wait()
        return parts


class ThreadRank(TensorParallel):
    """A rank whose group is a ``ThreadGroup``."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.rank, x) if self.size > 1 else x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        return self.group.gather(self.rank, x) if self.size > 1 else [x]


def rank_model(directory, tp: TensorParallel):
    """The model of ``directory`` holding ``tp``'s share, in float32 with torch's kernels."""
    cfg = read_model_config(directory)
    model = build_model(cfg, tp)
    missing = model.load_hf_weights(load_file(str(directory / "model.safetensors")))
    assert not missing, missing
    return model.eval(), cfg


def generate(model, cfg, tp: TensorParallel, prompt: list[int], out: dict) -> None:
    """Greedy decoding through ``model`` on its own paged cache: ``out`` gets the tokens, the
    logits of every step and the cache."""
    nh, nkv = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
    cache = KVCacheSpec(cfg.num_layers, BLOCK, nkv, cfg.head_dim, torch.float32).allocate(NUM_BLOCKS, torch.device("cpu"))
    backend = SdpaAttention(nh, nkv, cfg.head_dim, cfg.attention_scale)  # the model's softmax scale (Granite's)
    model.bind_caches([layer_views(cache, i) for i in range(cfg.num_layers)], backend)
    table, tokens, logits = list(range(NUM_BLOCKS)), list(prompt), []
    with torch.inference_mode():
        for step in range(NEW_TOKENS):
            start = 0 if step == 0 else len(tokens) - 1
            ctx, positions = build_context([start], [len(tokens) - start], [table], BLOCK, torch.device("cpu"),
                                           decode=step > 0)
            hidden = model(torch.tensor(tokens[start:]), positions, ctx)
            step_logits = model.compute_logits(hidden[-1:])  # every rank's slice, whole on rank 0
            if step_logits is not None:
                logits.append(step_logits[0])
            tokens.append(tp.group.next_token(tp.rank, logits[-1] if logits else None))
    out.update(tokens=tokens[len(prompt):], logits=torch.stack(logits) if logits else None, cache=cache)


def run_ranks(directory, size: int, prompt: list[int]) -> list[dict]:
    group = ThreadGroup(size)
    ranks = [ThreadRank(rank=r, size=size, group=group) for r in range(size)]
    models = [rank_model(directory, tp) for tp in ranks]
    outs: list[dict] = [{} for _ in ranks]
    threads = [threading.Thread(target=generate, args=(m, cfg, tp, prompt, o))
               for (m, cfg), tp, o in zip(models, ranks, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(outs), "a rank's thread failed (its traceback is above)"
    return outs

"""The families of tests/families.py (Qwen3, Qwen3-MoE, Phi-3, Gemma 3) split over two
tensor-parallel ranks (Megatron's split; each expert split in width) compute what the whole
model computes.

The TP runtime (a process per rank, gloo) is not what this checks: here both ranks run in
this process, one thread each, and ``ThreadGroup`` stands in for the gloo group: its
all-reduce hands every rank the sum of the ranks' tensors, in rank order, as gloo's does.
Each rank loads its share from the same checkpoint (``load_hf_weights`` cuts it), keeps its
share of the KV heads in its own paged cache, and the test checks, against the unsharded
model: the greedy tokens, the logits, and that each rank's cache holds exactly its heads of
the whole model's cache.
"""

import threading

import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.attention import SdpaAttention, build_context
from pdserve.engine.models.registry import build_model
from pdserve.engine.kv_cache import KVCacheSpec, layer_views
from pdserve.engine.loader import read_model_config
from pdserve.engine.parallel import ShardError, TensorParallel
from tests.factories import random_prompts
from tests.families import FAMILIES, save_family_model

BLOCK, NUM_BLOCKS, NEW_TOKENS = 16, 16, 6


class ThreadGroup:
    """A stand-in for a gloo process group of ``size`` ranks, one thread per rank."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=120)
        self.parts: list[torch.Tensor | None] = [None] * size
        self.token: int | None = None  # rank 0's latest, for the others (the runtime broadcasts it)

    def next_token(self, rank: int, logits: torch.Tensor | None) -> int:
        """Rank 0 alone has the LM head and samples; every rank takes its token as its next input."""
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


class ThreadRank(TensorParallel):
    """A rank whose group is a ``ThreadGroup``."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.rank, x) if self.size > 1 else x


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
    backend = SdpaAttention(nh, nkv, cfg.head_dim, cfg.attention_scale)  # the family's softmax scale (Gemma 3's)
    model.bind_caches([layer_views(cache, i) for i in range(cfg.num_layers)], backend)
    table, tokens, logits = list(range(NUM_BLOCKS)), list(prompt), []
    with torch.inference_mode():
        for step in range(NEW_TOKENS):
            start = 0 if step == 0 else len(tokens) - 1
            ctx, positions = build_context([start], [len(tokens) - start], [table], BLOCK, torch.device("cpu"),
                                           decode=step > 0)
            hidden = model(torch.tensor(tokens[start:]), positions, ctx)
            if model.has_head:
                logits.append(model.compute_logits(hidden[-1:])[0])
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


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return save_family_model(request.param, tmp_path_factory.mktemp(request.param))[0]


def test_two_ranks_compute_the_whole_model(family_dir):
    prompt = random_prompts(1, [37], seed=3)[0]
    whole = run_ranks(family_dir, 1, prompt)[0]
    ranks = run_ranks(family_dir, 2, prompt)
    for r, out in enumerate(ranks):
        assert out["tokens"] == whole["tokens"], f"rank {r}"
        if r == 0:  # the only rank with an LM head
            torch.testing.assert_close(out["logits"], whole["logits"], rtol=1e-4, atol=1e-4)
        nkv = out["cache"].shape[-2]  # (blocks, block_size, layers, 2, kv heads of this rank, head_dim)
        assert nkv * 2 == whole["cache"].shape[-2]
        torch.testing.assert_close(out["cache"], whole["cache"][..., r * nkv:(r + 1) * nkv, :], rtol=1e-5, atol=1e-5)


def test_a_split_that_does_not_divide_names_the_dimension(family_dir):
    cfg = read_model_config(family_dir)
    with pytest.raises(ShardError, match="num_key_value_heads"):
        build_model(cfg, TensorParallel(rank=0, size=cfg.num_kv_heads * 2))

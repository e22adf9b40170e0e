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


import pytest
import torch

from pdserve.engine.models.registry import build_model
from pdserve.engine.loader import read_model_config
from pdserve.engine.parallel import ShardError, TensorParallel
from tests.factories import random_prompts
from tests.helpers.thread_ranks import run_ranks
from tests.families import FAMILIES, save_family_model

@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return save_family_model(request.param, tmp_path_factory.mktemp(request.param))[0]


def test_two_ranks_compute_the_whole_model(family_dir):
    prompt = random_prompts(1, [37], seed=3)[0]
    whole = run_ranks(family_dir, 1, prompt)[0]
    ranks = run_ranks(family_dir, 2, prompt)
    for r, out in enumerate(ranks):
        assert out["tokens"] == whole["tokens"], f"rank {r}"
        if r == 0:  # the only rank the logits are gathered to
            torch.testing.assert_close(out["logits"], whole["logits"], rtol=1e-4, atol=1e-4)
        nkv = out["cache"].shape[-2]  # (blocks, layers, 2, block_size, kv heads of this rank, head_dim)
        assert nkv * 2 == whole["cache"].shape[-2]
        torch.testing.assert_close(out["cache"], whole["cache"][..., r * nkv:(r + 1) * nkv, :], rtol=1e-5, atol=1e-5)


def test_a_split_that_does_not_divide_names_the_dimension(family_dir):
    cfg = read_model_config(family_dir)
    with pytest.raises(ShardError, match="num_key_value_heads"):
        build_model(cfg, TensorParallel(rank=0, size=cfg.num_kv_heads * 2))

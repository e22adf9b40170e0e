"""The MoE layer (pdserve/engine/layers/moe.py) against transformers' Qwen3-MoE block on the same
weights, and its tensor-parallel split: the ranks' partial outputs sum to the whole layer."""

import pytest
import torch

from pdserve.engine.layers.moe import RoutedExperts, SoftmaxTopKGate, SparseMoe
from pdserve.engine.parallel import TensorParallel

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 2


def hf_block(norm_topk_prob: bool):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                  num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def ours(block, tp: TensorParallel = TensorParallel(), norm_topk_prob: bool = True) -> SparseMoe:
    """Our layer holding ``tp``'s share of ``block``'s weights (gate and up narrowed apart)."""
    moe = SparseMoe(SoftmaxTopKGate(HIDDEN, EXPERTS, TOP_K, norm_topk_prob),
                    RoutedExperts(EXPERTS, HIDDEN, INTER, tp), tp)
    with torch.no_grad():
        moe.gate.proj.weight.copy_(block.gate.weight)
        for e, expert in enumerate(moe.experts):
            gate, up = block.experts.gate_up_proj[e].chunk(2, dim=0)  # (I, H) each
            expert.gate_up_proj.weight.copy_(torch.cat([tp.narrow(gate, 0, "I"), tp.narrow(up, 0, "I")]))
            expert.down_proj.weight.copy_(tp.narrow(block.experts.down_proj[e], 1, "I"))
    return moe.eval()


class NoReduce(TensorParallel):
    """A rank of a TP group whose all-reduce is left to the test: this test runs both ranks
    in one process and sums their partial outputs itself (what gloo's all-reduce computes)."""

    def all_reduce(self, x):
        return x


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_equals_transformers_block(norm_topk_prob):
    block = hf_block(norm_topk_prob)
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
        got = ours(block, norm_topk_prob=norm_topk_prob)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_every_expert_is_used_and_a_token_reads_only_its_own():
    """The routing the test above checks is not degenerate, and a row's output depends on
    its own token alone (computed alone, it is the same)."""
    block = hf_block(True)
    moe = ours(block)
    x = torch.randn(64, HIDDEN)
    with torch.no_grad():
        _, ids = moe.gate(x)
        whole = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(0, 64, 9)])
    assert set(ids.flatten().tolist()) == set(range(EXPERTS))
    torch.testing.assert_close(alone, whole[::9], rtol=1e-6, atol=1e-6)


def test_two_ranks_partial_outputs_sum_to_the_whole_layer():
    block = hf_block(True)
    x = torch.randn(29, HIDDEN)
    with torch.no_grad():
        whole = ours(block)(x)
        parts = [ours(block, NoReduce(rank=r, size=2))(x) for r in range(2)]
    assert parts[0].shape == whole.shape
    assert not torch.allclose(parts[0], whole, atol=1e-3)  # each rank holds only part of the answer
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
    assert ours(block, NoReduce(rank=1, size=2)).experts[0].down_proj.in_features == INTER // 2

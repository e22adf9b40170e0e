"""The embedding and the LM head split by vocabulary rows (pdserve/engine/layers/vocab.py).

Each rank holds 1/N of the rows (the vocabulary padded up to a multiple of N), reads only
those from the checkpoint, and together the ranks compute the whole model's lookups and
logits, the logits gathered to rank 0 alone. Ranks here are threads of this process
(tests/helpers/thread_ranks.py, the gloo group's stand-in); tests/engine/test_tensor_parallel.py
runs the real runtime (a process per rank).
"""

import threading

import pytest
import torch

from pdserve.engine.checkpoint import InMemoryTensor
from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding, VocabShard
from pdserve.engine.models.registry import build_model, model_config_from_hf
from pdserve.engine.parallel import SINGLE
from tests.factories import assert_greedy_matches, make_hf_model, random_prompts, save_hf_model
from tests.helpers.thread_ranks import NEW_TOKENS, ThreadGroup, ThreadRank, run_ranks

HIDDEN = 64
# Llama-3.1-8B's shape (untied), for the memory a rank holds: built on the meta device.
LLAMA_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


class RecordedTensor(InMemoryTensor):
    """A checkpoint tensor that notes each read, to show a rank reads only its rows."""

    def __init__(self, name: str, tensor: torch.Tensor):
        super().__init__(name, tensor)
        self.reads: list[tuple] = []

    def read(self, dim=None, start=0, length=None):
        self.reads.append((dim, start, length))
        return super().read(dim, start, length)


def on_ranks(size: int, fn) -> list:
    """``fn(tp)`` on ``size`` thread ranks at once; each rank's result, in rank order."""
    group = ThreadGroup(size)
    out: list = [None] * size
    errors: list[BaseException] = []

    def run(rank):
        try:
            out[rank] = fn(ThreadRank(rank=rank, size=size, group=group))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def split_layers(vocab: int, weight: torch.Tensor, tied: bool, packed: bool):
    """``fn(tp)`` building the rank's embedding and head from ``weight`` (vocab, HIDDEN)."""
    def build(tp):
        emb = VocabParallelEmbedding(vocab, HIDDEN, tp)
        emb.load_weight("weight", InMemoryTensor("embed_tokens.weight", weight))
        head = ParallelLMHead(vocab, HIDDEN, tp, tied=emb if tied else None)
        if not tied:
            head.load_weight("weight", InMemoryTensor("lm_head.weight", weight))
        if packed:
            from pdserve.engine.linear import PackedCpuBackend

            head.use_kernel(PackedCpuBackend(torch.float32).logits_head(head.matrix(), None))
        return emb, head
    return build


@pytest.mark.parametrize("vocab", [512, 509])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("size", [2, 3])
def test_split_lookups_and_logits_equal_the_whole_bit_for_bit(vocab, tied, size):
    """The lookup is exact (one rank's row plus zeros), and each logit is the same dot
    product: with the packed kernel (one float32 chain per element, wherever its row sits)
    rank 0 gathers exactly the unsplit head's logits, the padding rows dropped."""
    packed = cpu_kernels.cpu_supported()
    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, HIDDEN, generator=g)
    ids = torch.tensor([0, 1, vocab // 3, vocab // 2, vocab - 2, vocab - 1, 7, 7])
    hidden = torch.randn(5, HIDDEN, generator=g)
    emb, head = split_layers(vocab, weight, tied, packed)(SINGLE)
    whole_rows, whole_logits = emb(ids), head.gather(head(hidden).float())
    assert torch.equal(whole_rows, weight[ids]) and whole_logits.shape == (5, vocab)

    def ranks(tp):
        emb, head = split_layers(vocab, weight, tied, packed)(tp)
        return emb(ids), head.gather(head(hidden).float())

    results = on_ranks(size, ranks)
    for rank, (rows, logits) in enumerate(results):
        assert torch.equal(rows, whole_rows), f"rank {rank}'s lookups"
        assert (logits is None) == (rank > 0)
    if packed:
        assert torch.equal(results[0][1], whole_logits)
    else:
        torch.testing.assert_close(results[0][1], whole_logits, rtol=1e-5, atol=1e-5)


def test_each_rank_reads_and_holds_only_its_rows_padding_zero():
    """509 rows over 2 ranks: 255 each, the last one padding on rank 1."""
    weight = torch.randn(509, HIDDEN)
    for rank, (start, real) in enumerate([(0, 255), (255, 254)]):
        tp = ThreadRank(rank=rank, size=2, group=None)
        tensor = RecordedTensor("lm_head.weight", weight)
        head = ParallelLMHead(509, HIDDEN, tp)
        head.load_weight("weight", tensor)
        assert tensor.reads == [(0, start, real)]
        assert head.weight.shape == (255, HIDDEN)
        assert torch.equal(head.weight[:real], weight[start:start + real])
        assert not head.weight[real:].any()
    with pytest.raises(ValueError, match=r"tensor lm_head.weight: shape \(510, 64\), expected \(509, 64\)"):
        ParallelLMHead(509, HIDDEN).load_weight("weight", InMemoryTensor("lm_head.weight", torch.zeros(510, HIDDEN)))
    with pytest.raises(ValueError, match="vocab_size must be at least 1, got 0"):
        VocabShard(0, 1, 0)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_a_rank_of_the_8b_shape_holds_1_over_n_of_the_embedding_and_head(size):
    """Llama-3.1-8B (vocab 128,256, hidden 4,096, untied): every rank holds 128,256 / N rows of
    each, where rank 0 used to hold the whole embedding and the whole head."""
    cfg = model_config_from_hf(LLAMA_8B, "llama-3.1-8b")
    rows = -(-128256 // size)
    for rank in (0, size - 1):
        with torch.device("meta"):
            model = build_model(cfg, ThreadRank(rank=rank, size=size, group=None))
        assert model.embed_tokens.weight.shape == (rows, 4096)
        assert model.lm_head.weight.shape == (rows, 4096)
        vocab_params = model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
        assert vocab_params * size == pytest.approx(2 * 128256 * 4096, rel=1e-4)


@pytest.fixture(scope="module", params=["tied", "untied", "tied-odd-vocab", "untied-odd-vocab"])
def vocab_model(request, tmp_path_factory):
    """A tiny Llama (tests/factories.py), its head tied as SmolLM2's or not, its vocabulary
    512 rows or 511 (which two ranks do not divide)."""
    overrides = {"tie_word_embeddings": request.param.startswith("tied")}
    if request.param.endswith("odd-vocab"):
        overrides["vocab_size"] = 511
    hf = make_hf_model("llama", seed=21, **overrides)
    return save_hf_model(hf, tmp_path_factory.mktemp(request.param)), hf


def test_two_ranks_generate_what_one_rank_and_transformers_generate(vocab_model):
    directory, hf = vocab_model
    prompt = random_prompts(1, [29], vocab=hf.config.vocab_size, seed=4)[0]
    whole = run_ranks(directory, 1, prompt)[0]
    ranks = run_ranks(directory, 2, prompt)
    assert_greedy_matches(hf, prompt, whole["tokens"], NEW_TOKENS, what="tp 1")
    assert [r["tokens"] for r in ranks] == [whole["tokens"]] * 2
    assert ranks[1]["logits"] is None  # gathered to rank 0 alone
    assert ranks[0]["logits"].shape == (NEW_TOKENS, hf.config.vocab_size)
    torch.testing.assert_close(ranks[0]["logits"], whole["logits"], rtol=1e-4, atol=1e-4)

"""CUDA graphs on the check's device (``--cuda-graphs``, pdserve/engine/cuda_graphs.py and, for
steps with prompt tokens, piecewise.py): captured at start, replayed by decode steps of mixed
batch sizes and context lengths and by prompt chunks and mixed steps, and the tokens they give
are transformers' (float32 greedy, near ties aside) and close to them in bfloat16. What decides whether ``--cuda-graphs`` can be on by default. Never run on a GPU
where it was written; on the CPU dry run it skips (graphs need CUDA; tests/engine/
test_cuda_graphs.py runs the same buffers and padding there without a graph)."""

import pytest
import torch

from pdserve.engine.cuda_graphs import capture_sizes
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine
from tests.gpu.smol import reference
from tests.helpers.device_checks import PROMPTS, assert_bf16_close, assert_device_greedy

pytestmark = pytest.mark.cuda

MAX_TOKENS = 24


@pytest.fixture(autouse=True)
def cuda_only(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need CUDA (tests/engine/test_cuda_graphs.py covers the rest on the CPU)")


def _graphed(smol_dir, device, dtype, max_num_seqs=8):
    engine = make_engine(smol_dir, dtype=dtype, device=device.type, attention_backend="triton", cuda_graphs=True,
                         num_blocks=512, max_num_batched_tokens=64, max_num_seqs=max_num_seqs)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == capture_sizes(max_num_seqs)
    return engine


def test_float32_through_graphs_equals_transformers(smol_dir, device):
    """Four prompts of 5 to 300 tokens, prefilled in chunks of 64: decode steps of one to
    four sequences, replayed from the graphs of 1, 2 and 4 rows."""
    engine = _graphed(smol_dir, device, "float32")
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert engine.runner.graphs.replays > 0
    assert engine.runner.piecewise is not None and engine.runner.piecewise.replays > 0  # the prompt chunks
    hf = reference(smol_dir, torch.float32, device)
    for prompt, out in zip(PROMPTS, outs):
        assert_device_greedy(hf, prompt, out.token_ids, f"graphs, prompt of {len(prompt)}")


def test_float32_mixed_steps_through_the_pieces_equal_transformers(smol_dir, device):
    """The mixed policy (a decode worker's): prompts chunked 16 tokens a step beside the streams
    already decoding, every such step through the piecewise graphs (pdserve/engine/piecewise.py),
    the attention eager between them."""
    from pdserve.engine.config import MIXED

    engine = make_engine(smol_dir, dtype="float32", device=device.type, attention_backend="triton", cuda_graphs=True,
                         num_blocks=512, max_num_batched_tokens=64, max_num_seqs=8, policy=MIXED,
                         mixed_prefill_tokens=16)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert engine.runner.piecewise.replays > 0 and engine.runner.graphs.replays > 0
    hf = reference(smol_dir, torch.float32, device)
    for prompt, out in zip(PROMPTS, outs):
        assert_device_greedy(hf, prompt, out.token_ids, f"pieces, prompt of {len(prompt)}")


def test_bfloat16_through_graphs_is_close_to_transformers(smol_dir, device):
    engine = _graphed(smol_dir, device, "bfloat16")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
    outs = engine.generate(PROMPTS, params)
    assert engine.runner.graphs.replays > 0
    assert_bf16_close(reference(smol_dir, torch.float32, device), reference(smol_dir, torch.bfloat16, device),
                      PROMPTS, outs, "graphs")


def test_a_batch_of_64_mixed_lengths_replays_and_matches_the_eager_engine(smol_dir, device):
    """64 sequences of 8 to 260 tokens: a graph of 64 rows, and every sequence's float32 greedy
    tokens those of the eager engine (the same kernels, captured), near ties aside."""
    prompts = [[3 + (5 * i + 3 * k) % 256 for i in range(8 + (k * 37) % 253)] for k in range(64)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    graphed = make_engine(smol_dir, dtype="float32", device=device.type, attention_backend="triton",
                          cuda_graphs=True, num_blocks=2048, max_num_seqs=64)
    eager = make_engine(smol_dir, dtype="float32", device=device.type, attention_backend="triton",
                        num_blocks=2048, max_num_seqs=64)
    ours, theirs = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert graphed.runner.graphs.replays > 0 and eager.runner.graphs is None
    differ = [k for k, (a, b) in enumerate(zip(ours, theirs)) if a.token_ids != b.token_ids]
    hf = reference(smol_dir, torch.float32, device) if differ else None
    for k in differ:
        assert_device_greedy(hf, prompts[k], ours[k].token_ids, f"graphs, batch of 64, prompt {k}")

"""Steps with prompt tokens as piecewise CUDA graphs (pdserve/engine/piecewise.py), all but the
capture: which sizes are captured, which models can be cut at their attention calls, and the
engine stepping through the pieces' static buffers (padded to a size, the attention eager
between them) giving the eager engine's tokens and cache, bit for bit, in float32.

No GPU here: ``PiecewiseGraphs(capture=False)`` runs the same pieces on the same buffers without
graphs. The capture itself, and the pieces giving the eager step's tokens on a GPU, are
tests/gpu/test_cuda_graphs.py's.
"""

import pytest
import torch

from pdserve.engine.config import MIXED
from pdserve.engine.piecewise import TOKEN_SIZES, PiecewiseGraphs, token_sizes, unsupported
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, make_hf_model, random_prompts, save_hf_model


def test_the_sizes_captured_reach_the_first_that_holds_the_token_budget():
    assert token_sizes(1) == (32,)
    assert token_sizes(256) == (32, 64, 128, 192, 256)
    assert token_sizes(600) == (32, 64, 128, 192, 256, 320, 384, 448, 512, 640)
    assert token_sizes(1 << 20) == TOKEN_SIZES  # past the largest, eagerly
    sizes = token_sizes(2048)
    # a quarter at most from 256 tokens on; below, where a GPU's linears are bound by reading the
    # weights, not by the tokens, up to twice
    assert all(min(s for s in sizes if s >= t) <= (1.25 * t if t >= 256 else max(32, 2 * t)) for t in range(1, 2049))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    """Llama's layers, and Qwen3's (a norm over q and over k inside the projection's piece)."""
    extra = {"head_dim": 16} if request.param == "qwen3" else {}
    return save_hf_model(make_hf_model(request.param, **extra), tmp_path_factory.mktemp(request.param))


def test_the_engine_through_the_pieces_gives_the_eager_tokens_and_cache(model_dir):
    """Prompts chunked beside streams (mixed steps of 3 to 16 tokens, padded to 32), then decode
    steps, all through the pieces: the same tokens as the eager engine, and the same cache, bit
    for bit (the padding rows stored nothing)."""
    prompts = random_prompts(3, [3, 7, 20], seed=2)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engines = [make_engine(model_dir, enable_prefix_cache=False, policy=MIXED, max_num_batched_tokens=16,
                           mixed_prefill_tokens=8) for _ in range(2)]
    runner = engines[0].runner
    assert unsupported(runner.model) is None
    runner.piecewise = pieces = PiecewiseGraphs(runner.model, token_sizes(16), runner.device, capture=False)
    assert pieces.sizes == (32,)
    eager_calls, forward = [], runner.model.forward
    runner.model.forward = lambda *args: eager_calls.append(args) or forward(*args)
    cut, eager = (e.generate(prompts, params) for e in engines)
    assert pieces.replays > 5 and not eager_calls  # every step through the pieces
    assert [o.token_ids for o in cut] == [o.token_ids for o in eager]
    assert torch.equal(engines[0].kv_cache, engines[1].kv_cache)


def test_a_model_with_a_forward_of_its_own_is_not_cut_and_says_why(tmp_path):
    directory = save_hf_model(make_hf_model("granite"), tmp_path / "granite")
    engine = make_engine(directory)
    reason = unsupported(engine.runner.model)
    assert reason is not None and "Granite" in reason
    with pytest.raises(ValueError, match="cannot cut"):
        PiecewiseGraphs(engine.runner.model, (32,), engine.runner.device, capture=False)


def test_a_step_larger_than_every_size_runs_eagerly(model_dir):
    engine = make_engine(model_dir, enable_prefix_cache=False)
    runner = engine.runner
    runner.piecewise = pieces = PiecewiseGraphs(runner.model, (32,), runner.device, capture=False)
    eager_calls, forward = [], runner.model.forward
    runner.model.forward = lambda *args: eager_calls.append(args[0].shape[0]) or forward(*args)
    out = engine.generate(random_prompts(1, [40], seed=3), SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
    assert eager_calls == [40] and pieces.replays == 1  # the prompt eagerly, the decode step through the pieces

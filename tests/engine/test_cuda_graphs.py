"""CUDA graphs for decode (pdserve/engine/cuda_graphs.py), all but the capture: which sizes
are captured, which one a step replays, how a step's inputs are padded to it, and the whole
engine stepping through the graphs' static buffers.

No GPU here: ``DecodeGraphs(capture=False)`` builds the same buffers and padding and runs the
forward on them without a graph, on the Triton backend in Triton's interpreter (the backend
graphs need). The capture itself, and graphs giving the eager step's tokens on a GPU, are
tests/gpu/test_cuda_graphs.py's.
"""

import torch

from pdserve.engine.attention.base import host_context
from pdserve.engine.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes, padded_inputs
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, random_prompts


def test_the_sizes_captured_reach_the_first_that_holds_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(33) == (1, 2, 4, 8, 16, 24, 32, 40)
    # the scheduler's default limit: every decode step it can schedule has a graph
    assert capture_sizes(256)[-1] == 256 and capture_sizes(1000)[-1] == 256  # past 256, eagerly
    sizes = capture_sizes(256)
    assert all(bucket_for(b, sizes) - b <= max(7, bucket_for(b, sizes) // 5) for b in range(1, 257))


def test_a_step_replays_the_smallest_size_that_holds_it():
    sizes = (1, 2, 4, 8)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_padding_rows_touch_no_slot_and_read_no_context():
    starts, tables = [4, 16, 40], [[7], [2, 3], [9, 1, 5]]  # three decode rows, 5 / 17 / 41 tokens
    host = host_context(starts, [1, 1, 1], tables, 16, decode=True)
    tokens = torch.tensor([11, 12, 13])
    ids, positions, slot_block, slot_offset, block_tables, context_lens = padded_inputs(host, tokens, 4, 6)
    assert ids.tolist() == [11, 12, 13, 0] and positions.tolist() == [4, 16, 40, 0]
    assert slot_block.tolist() == [7, 3, 5, -1] and slot_offset.tolist() == [4, 0, 8, 0]
    assert block_tables.tolist() == [[7, 0, 0, 0, 0, 0], [2, 3, 0, 0, 0, 0], [9, 1, 5, 0, 0, 0], [0] * 6]
    assert context_lens.tolist() == [5, 17, 41, 0]
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32 and slot_block.dtype == torch.int64


def test_a_step_that_does_not_fit_is_refused():
    host = host_context([0, 0], [1, 1], [[1], [2]], 16, decode=True)
    for size, width in ((1, 4), (2, 0)):
        try:
            padded_inputs(host, torch.tensor([1, 2]), size, width)
        except ValueError as exc:
            assert "does not fit" in str(exc)
        else:
            raise AssertionError(f"a step of 2 rows x 1 block fit a graph of {size} x {width}")


def test_the_engine_through_the_graphs_buffers_gives_the_eager_tokens_and_cache(tiny_llama_dir):
    """Three sequences decode as a graph of four rows (one padding row): the same tokens as
    the eager engine, and the same cache, bit for bit (the padding row wrote nowhere)."""
    directory, _ = tiny_llama_dir
    prompts = random_prompts(3, [3, 7, 20], seed=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engines = [make_engine(directory, attention_backend="triton", enable_prefix_cache=False) for _ in range(2)]
    runner = engines[0].runner
    runner.graphs = DecodeGraphs(runner._logits, (1, 2, 4), 8, runner.block_size, runner.device, capture=False)
    graphed, eager = (e.generate(prompts, params) for e in engines)
    assert runner.graphs.replays == 3  # the decode steps after the prompts' step
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert torch.equal(engines[0].kv_cache, engines[1].kv_cache)


def test_at_tp2_every_rank_steps_through_its_graphs_buffers_with_rank_0s_inputs(tiny_llama_dir):
    """Two ranks (gloo): rank 0 builds its graphs and the other rank builds the same; each
    graphed decode step hands the padded inputs over, and both run the step from their static
    buffers (on a GPU per rank, each replays its captured graph). The tokens are one rank's,
    eager, and transformers'."""
    from tests.factories import hf_greedy, make_tp_engine

    directory, hf = tiny_llama_dir
    prompts = random_prompts(3, [3, 7, 20], seed=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tp2 = make_tp_engine(directory, 2, attention_backend="triton", enable_prefix_cache=False, num_blocks=64)
    try:
        runner = tp2.runner
        assert runner.graphs is None  # --cuda-graphs is off in the tests' engines, and this is the CPU
        runner.graphs = runner.build_graphs((1, 2, 4), 8, capture=False)
        graphed = [o.token_ids for o in tp2.generate(prompts, params)]
        assert runner.graphs.replays == 3  # the decode steps after the prompts' step, 3 rows in a graph of 4
    finally:
        tp2.close()
    assert graphed == [hf_greedy(hf, p, 4) for p in prompts]

"""The staggered-context engine benchmark computes what it claims: the engine's staggered batch and
transformers' left-padded batch both give each sequence its own solo greedy tokens (float32, tiny
random Llama), so the two step times it compares are times of the same, correct work."""

from __future__ import annotations

import torch

from benchmarks.engine_staggered import engine_steps, hf_steps, prompts, spread
from tests.factories import hf_greedy, load_reference, make_engine


def test_spread_covers_both_ends():
    assert spread(16, 64, 1024)[0] == 64 and spread(16, 64, 1024)[-1] == 1024
    assert spread(5, 10, 50) == [10, 20, 30, 40, 50]
    assert spread(1, 64, 1024) == [64]


def test_staggered_batches_match_solo_greedy(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    batch = prompts(spread(4, 5, 70), vocab=512, seed=3)
    steps = 5
    _, ours = engine_steps(make_engine(directory, max_num_seqs=8), batch, steps, n_threads=1, tag="t")
    times, theirs = hf_steps(load_reference(directory, dtype=torch.float32), batch, steps, n_threads=1)
    reference = load_reference(directory, dtype=torch.float32)
    solo = [hf_greedy(reference, p, steps + 3) for p in batch]
    assert len(times) == steps
    assert ours == solo
    assert theirs == solo

"""The draft-model proposer (pdserve/engine/spec/draft.py) on a tiny random Llama as its own
draft: its greedy guesses are the draft's greedy continuation (transformers' generate of the
same weights), again after the target keeps fewer of them; sampled guesses come with the
distributions they were drawn from; forgetting frees every block; a full cache proposes nothing
rather than fail; a draft of another vocabulary or an unknown family is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.loader import read_model_config
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.spec.draft import DraftProposer
from tests.factories import assert_greedy_matches, engine_config, make_hf_model, random_prompts, save_hf_model

K = 4


def proposer(directory, num_blocks: int = 256, k: int = K, **scheduler) -> DraftProposer:
    spec = SpeculativeConfig(method="draft_model", model=str(directory), num_speculative_tokens=k)
    return DraftProposer.from_config(spec, engine_config(directory, num_blocks=num_blocks, **scheduler),
                                     read_model_config(directory))


def seqs_of(prompts, params=SamplingParams()) -> list[Sequence]:
    return [Sequence(f"s{i}", list(p), params) for i, p in enumerate(prompts)]


def test_greedy_guesses_are_the_drafts_continuation_before_and_after_a_rejection(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    draft = proposer(directory)
    seqs = seqs_of(random_prompts(3, [5, 23, 40], seed=3))
    first = draft.propose(seqs, K)
    for seq, proposal in zip(seqs, first):
        assert proposal.probs is None
        assert_greedy_matches(hf, seq.token_ids, proposal.token_ids, K, what=f"{seq.seq_id} first proposal")
    # The target keeps guess 1 of s0 and replaces guess 2 with another token, keeps all of s1's
    # and adds its own, and keeps none of s2's.
    s0, s1, s2 = seqs
    s0.token_ids += [first[0].token_ids[0], (first[0].token_ids[1] + 1) % 512]
    s1.token_ids += first[1].token_ids + [7]
    s2.token_ids += [(first[2].token_ids[0] + 5) % 512]
    before = draft.runner.num_forward_tokens
    second = draft.propose(seqs, K)
    for seq, proposal in zip(seqs, second):
        assert_greedy_matches(hf, seq.token_ids, proposal.token_ids, K, what=f"{seq.seq_id} after the verification")
    # Only what the draft had not computed ran again: s0 the target's token after guess 1, s1
    # its last guess (never run) and the target's token, s2 the target's token; then K - 1
    # single-token steps of three rows.
    assert draft.runner.num_forward_tokens - before == 1 + 2 + 1 + 3 * (K - 1)
    draft.blocks.check_invariants()


def test_a_sequence_shorter_than_the_last_one_seen_starts_over_from_their_common_prefix(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    draft = proposer(directory)
    [seq] = seqs_of(random_prompts(1, [30], seed=5))
    draft.propose([seq], K)
    seq.token_ids = seq.token_ids[:12] + [9, 10]  # the same id, another history (a migrated stream)
    [again] = draft.propose([seq], K)
    assert_greedy_matches(hf, seq.token_ids, again.token_ids, K, what="after a rewrite")


def test_sampled_guesses_come_with_the_rows_they_were_drawn_from(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    draft = proposer(directory)
    prompt = random_prompts(1, [17], seed=8)[0]
    hot = SamplingParams(temperature=3.0, seed=11)
    greedy, sampled = draft.propose([Sequence("g", list(prompt), SamplingParams()),
                                     Sequence("t", list(prompt), hot)], K)
    assert greedy.probs is None
    assert sampled.probs.shape == (K, 512) and sampled.probs.dtype == torch.float32
    torch.testing.assert_close(sampled.probs.sum(dim=-1), torch.ones(K))
    assert all(sampled.probs[i, t] > 0 for i, t in enumerate(sampled.token_ids))
    with torch.no_grad():  # row 0 is the draft's softmax at the request's temperature
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(sampled.probs[0], torch.softmax(logits / 3.0, dim=-1), atol=1e-5, rtol=1e-4)
    # The same seed guesses the same tokens, whatever the batch; the first guess follows row 0.
    [alone] = draft.propose([Sequence("t2", list(prompt), hot)], K)
    assert alone.token_ids == sampled.token_ids
    draws = 120  # one batch, a seed each (the cache makes room by evicting the sequences above)
    firsts = [p.token_ids[0] for p in draft.propose(
        [Sequence(f"d{i}", list(prompt), SamplingParams(temperature=3.0, seed=i)) for i in range(draws)], 1)]
    for token in sampled.probs[0].topk(3).indices.tolist():
        p = float(sampled.probs[0, token])
        seen = firsts.count(token) / draws
        assert abs(seen - p) < 4 * (p * (1 - p) / draws) ** 0.5 + 1e-3, (token, seen, p)


def test_forget_frees_every_block_and_a_full_cache_proposes_nothing(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    draft = proposer(directory, num_blocks=6)  # 96 slots
    a, b, c = seqs_of(random_prompts(3, [40, 40, 100], seed=2))
    pa, pb, pc = draft.propose([a, b, c], K)
    assert pc.token_ids == [] and len(pa.token_ids) == len(pb.token_ids) == K  # c's 103 slots never fit
    assert_greedy_matches(hf, b.token_ids, pb.token_ids, K, what="b beside a sequence that did not fit")
    # A newcomer evicts the sequences proposed for least recently, outside its own call, until
    # it fits: c (which held nothing), then a; b keeps its KV.
    d = Sequence("d", random_prompts(1, [40], seed=4)[0], SamplingParams())
    [pd] = draft.propose([d], K)
    assert len(pd.token_ids) == K and draft.blocks.num_free_blocks == 0
    assert not draft.blocks.has("s0") and draft.blocks.has("s1")
    before = draft.runner.num_forward_tokens
    b.token_ids += pb.token_ids[:2] + [5]
    assert_greedy_matches(hf, b.token_ids, draft.propose([b], K)[0].token_ids, K, what="b after the eviction")
    assert draft.runner.num_forward_tokens - before == 1 + K - 1  # b's KV was kept: its token after guess 2 ran
    draft.blocks.check_invariants()
    for seq_id in ("s0", "s1", "s2", "d", "s1"):
        draft.forget(seq_id)
    draft.forget("never-seen")
    assert draft.num_tracked == 0 and draft.blocks.num_free_blocks == 6
    draft.blocks.check_invariants()


def test_guesses_stop_at_the_end_of_the_context(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    spec = SpeculativeConfig(method="draft_model", model=str(directory), num_speculative_tokens=K)
    config = engine_config(directory)
    draft = DraftProposer.from_config(spec, config.__class__(**{**config.__dict__, "max_model_len": 32}),
                                      read_model_config(directory))
    seqs = seqs_of([list(range(3, 32)), list(range(3, 34)), list(range(3, 35))])  # 29, 31 and 32 tokens
    near, last, full = draft.propose(seqs, K)
    assert len(near.token_ids) == 3 and len(last.token_ids) == 1 and full.token_ids == []
    assert_greedy_matches(hf, seqs[0].token_ids, near.token_ids, 3, what="near the end")


def test_a_draft_of_another_vocabulary_or_family_is_refused_by_name(tiny_llama_dir, tmp_path):
    directory, _ = tiny_llama_dir
    small = save_hf_model(make_hf_model("llama", vocab_size=256), tmp_path / "small-vocab")
    spec = SpeculativeConfig(method="draft_model", model=str(small))
    with pytest.raises(ValueError, match=r"speculative_config\.model.*256.*512"):
        DraftProposer.from_config(spec, engine_config(directory), read_model_config(directory))
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert",
                                                   "vocab_size": 512}))
    spec = SpeculativeConfig(method="draft_model", model=str(other))
    with pytest.raises(ModelLoadError, match=r"speculative_config\.model.*unsupported architecture"):
        DraftProposer.from_config(spec, engine_config(directory), read_model_config(directory))
    spec = SpeculativeConfig(method="draft_model", model=str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=r"speculative_config\.model"):
        DraftProposer.from_config(spec, engine_config(directory), read_model_config(directory))


def test_a_long_catch_up_is_spread_over_calls_within_the_step_budget(tiny_llama_dir):
    directory, hf = tiny_llama_dir
    draft = proposer(directory, max_num_batched_tokens=32)
    seqs = seqs_of(random_prompts(2, [40, 10], seed=6))
    first = draft.propose(seqs, K)
    assert [p.token_ids for p in first] == [[], []]  # 32 of s0's 40 tokens ran; nothing of s1's
    assert draft.runner.num_forward_tokens == 32
    second = draft.propose(seqs, K)
    for seq, proposal in zip(seqs, second):
        assert_greedy_matches(hf, seq.token_ids, proposal.token_ids, K, what=f"{seq.seq_id} once caught up")
    assert draft.runner.num_forward_tokens == 32 + 8 + 10 + 2 * (K - 1)

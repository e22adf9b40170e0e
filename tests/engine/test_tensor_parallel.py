"""Tensor parallelism inside one engine: rank 0 here, the other ranks its child processes
(gloo on loopback). A TP 2 engine gives transformers' float32 greedy tokens, as TP 1 does; a
request's tokens do not depend on its batch at TP 2 (bfloat16, pdserve's kernels); each rank's
cache holds its own KV heads; a lost rank is the engine's loss, never a wrong token."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.errors import RankLost
from pdserve.engine.models.registry import check_split
from pdserve.engine.parallel import ShardError
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import assert_greedy_matches, make_engine, make_tp_engine, random_prompts
from tests.helpers.engine_runs import LENGTHS, run_staggered
from tests.helpers.kv_layout import by_token

PROMPT_LENGTHS = [5, 40, 17, 90]
PROBE = Path(__file__).with_name("tp_reduce_probe.py")


@pytest.fixture(scope="module")
def tp2_f32(tiny_llama_dir):
    engine = make_tp_engine(tiny_llama_dir[0], 2, num_blocks=64)
    yield engine
    engine.close()


def test_a_split_that_does_not_divide_is_refused_naming_the_field_and_the_limit(tiny_llama_dir):
    from pdserve.engine.loader import read_model_config

    cfg = read_model_config(tiny_llama_dir[0])  # 4 heads, 2 KV heads, 128 intermediate rows
    check_split(cfg, 2)
    with pytest.raises(ShardError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        check_split(cfg, 3)
    with pytest.raises(ShardError, match=r"num_key_value_heads \(2\) is not divisible by tensor_parallel_size \(4\)"):
        check_split(cfg, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)


def _family_configs() -> dict[str, dict]:
    """Each family's small config (tests/families.py, tests/deepseek_models.py) as config.json."""
    from tests.deepseek_models import MLA_SHAPE, VARIANTS
    from tests.factories import TINY_LLAMA
    from tests.families import FAMILIES

    configs = {"llama": {**TINY_LLAMA, "model_type": "llama"}}
    configs.update({name: {**TINY_LLAMA, **fields, "model_type": model_type}
                    for name, (model_type, fields) in FAMILIES.items()})
    configs.update({name: {**TINY_LLAMA, **MLA_SHAPE, **fields, "model_type": model_type}
                    for name, (model_type, fields) in VARIANTS.items()})
    return configs


@pytest.mark.parametrize("family", list(_family_configs()))
def test_layers_of_one_kind_are_built_alike(family):
    """``check_split`` builds one layer of each kind (``CausalLM.layer_kind``); that holds only
    if every layer of a kind has the same modules and parameter shapes as the one built."""
    from pdserve.engine.models.registry import build_model, families, model_config_from_hf
    from pdserve.engine.parallel import TensorParallel

    cfg = model_config_from_hf(_family_configs()[family], family)
    with torch.device("meta"):
        model = build_model(cfg, TensorParallel(0, 2))
    built: dict = {}
    for index, layer in enumerate(model.layers):
        shape = [(name, type(m).__name__, tuple(p.shape) if isinstance(p := getattr(m, "weight", None),
                                                                      torch.Tensor) else None)
                 for name, m in layer.named_modules()]
        assert built.setdefault(families()[cfg.model_type].model.layer_kind(cfg, index), shape) == shape, index
    check_split(cfg, 2)
    if cfg.moe is not None:  # a dense layer and a layer of experts: two kinds, two layers built
        assert len(built) == 2


@pytest.mark.slow
def test_tp2_float32_greedy_equals_transformers_and_tp1(tiny_llama_dir, tp2_f32):
    directory, hf_model = tiny_llama_dir
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=11)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    tp1 = [c.token_ids for c in make_engine(directory, num_blocks=64).generate(prompts, params)]
    tp2 = [c.token_ids for c in tp2_f32.generate(prompts, params)]  # all four in one batch
    for prompt, ours in zip(prompts, tp2):
        assert_greedy_matches(hf_model, prompt, ours, 16, what="tp 2")
    assert tp2 == tp1
    assert tp2_f32.runner.ranks is not None and tp2_f32.tensor_parallel_size == 2


@pytest.mark.slow
def test_tp2_prompt_logprobs_equal_tp1_with_every_rank_in_each_slice(tiny_llama_dir, tp2_f32, monkeypatch):
    """The LM head is split by vocabulary rows: every logits rank 0 computes, the prompt
    logprobs' slices (32 rows each here, so several a prefill) as the sampled rows', is
    gathered from every rank. The followers compute theirs on rank 0's word alone; a slice
    they missed would leave them a collective behind and hang or fail the next step."""
    from pdserve.engine.runner import prompt_logprobs

    directory, _ = tiny_llama_dir
    monkeypatch.setattr(prompt_logprobs, "SLICE_BYTES", 4 * 512 * 32)  # rank 0 slices; the others follow it
    prompts = random_prompts(2, [90, 40], seed=14)
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    tp1 = make_engine(directory, num_blocks=64).generate(prompts, params)
    announced, announce = [], tp2_f32.ranks.logits
    monkeypatch.setattr(tp2_f32.ranks, "logits", lambda start, stop: (announced.append(stop - start),
                                                                      announce(start, stop)))
    tp2 = tp2_f32.generate(prompts, params)
    assert sum(announced) == 89 + 39 and max(announced) == 32  # every prompt row, 32 at a time
    for one, two in zip(tp1, tp2):
        assert two.token_ids == one.token_ids
        assert len(two.prompt_logprobs) == len(one.prompt_logprobs) > 32
        for (lp2, top2), (lp1, top1) in zip(two.prompt_logprobs, one.prompt_logprobs):
            assert lp2 == pytest.approx(lp1, abs=1e-4)
            assert [t for t, _ in top2] == [t for t, _ in top1]
    # and the ranks are still in step: a plain request after them
    assert tp2_f32.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids == \
        tp1[0].token_ids[:4]


@pytest.mark.slow
def test_each_rank_caches_its_own_kv_heads(tiny_llama_dir, tp2_f32):
    """Rank r's cache holds KV heads [r, r + 1) of 2 (the tiny model has 2 KV heads): the same
    values TP 1 computes there (layer 0 bit for bit: its inputs are the same on every rank), in
    the same block ids. Rank 1's cache is read here from rank 0's view of the shared file."""
    directory, _ = tiny_llama_dir
    prompt = random_prompts(1, [37], seed=12)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tp1 = make_engine(directory, num_blocks=64)
    kv = {}
    for name, engine in (("tp1", tp1), ("tp2", tp2_f32)):
        engine.add_request("r", prompt, params, hold_kv=True)
        while engine.has_unfinished():
            engine.step()
        blocks = engine.held_block_ids("r")
        caches = [engine.kv_cache] if engine.ranks is None else list(engine.ranks.caches)
        kv[name] = [by_token(c[blocks])[:len(prompt)] for c in caches]  # each (tokens, L, 2, heads, hd)
        engine.free_held("r")
    (whole,), ranks = kv["tp1"], kv["tp2"]
    assert [r.shape[-2] for r in ranks] == [1, 1]
    joined = torch.cat(ranks, dim=-2)
    assert torch.equal(joined[:, 0], whole[:, 0])
    torch.testing.assert_close(joined, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_staggered_requests_at_tp2_equal_their_solo_runs_bfloat16(tiny_llama_dir):
    """Batch invariance per layout: at TP 2 in bfloat16, a request's tokens are the same alone
    or joining a running batch, preempted or not (the all-reduce adds the same two partial sums
    whatever the batch)."""
    directory, _ = tiny_llama_dir
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=5)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    solo_engine = make_tp_engine(directory, 2, num_blocks=64, dtype="bfloat16")
    try:
        solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    finally:
        solo_engine.close()
    engine = make_tp_engine(directory, 2, num_blocks=40, dtype="bfloat16")  # too few: forces preemption
    try:
        together = run_staggered(engine, prompts, params)
        assert engine.scheduler.num_preemptions > 0
        assert engine.num_free_blocks == 40
    finally:
        engine.close()
    assert together == solo


@pytest.mark.slow
def test_a_lost_rank_stops_the_engine_before_any_wrong_token(tiny_llama_dir):
    """Killing rank 1: rank 0 learns of it (its watch, or the next collective), says so once,
    and every step from then on raises RankLost: no token comes from half a model."""
    directory, _ = tiny_llama_dir
    lost: list[RankLost] = []
    engine = make_tp_engine(directory, 2, num_blocks=64, on_rank_lost=lost.append)
    try:
        prompt = random_prompts(1, [20], seed=13)[0]
        engine.add_request("a", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
        first = engine.step()
        assert first and first[0].new_token_ids
        follower = engine.ranks._procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait()
        with pytest.raises(RankLost):
            for _ in range(50):
                engine.step()
        with pytest.raises(RankLost):
            engine.step()
        assert len(lost) == 1
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_the_all_reduce_adds_in_one_order_whatever_the_length(tmp_path, size):
    """Every rank gets rank 0's + rank 1's + ... in that order, bit for bit, for an element at
    any place in a buffer of any length: what makes a row's output the same in any batch.
    Values of very different sizes (1, 1e3, 1e6) round differently in every other order."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, str(PROBE), str(tmp_path / "store"), str(rank), str(size),
                               str(tmp_path / f"{rank}.pt")], env=env) for rank in range(size)]
    assert [p.wait(120) for p in procs] == [0] * size
    values = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) * 10 ** (3 * r) for r in range(size)]
    expected = values[0][:16].clone()
    for v in values[1:]:
        expected += v[:16]
    for rank in range(size):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got, expected.expand_as(got)), f"rank {rank}"


@pytest.mark.slow
def test_tp2_speculative_greedy_equals_transformers_with_prompt_chunks_in_the_same_steps(tiny_llama_dir):
    """Speculation at TP 2: each guess's logits are gathered to rank 0 with the sampled rows, in
    mixed steps beside prompt chunks (a budget of 48 tokens chunks the longer prompts)."""
    from pdserve.engine.config import SpeculativeConfig
    from pdserve.engine.core.outputs import run_to_completion

    directory, hf_model = tiny_llama_dir
    phrase, other = random_prompts(2, [7, 90], seed=13)
    prompts = [phrase * 5, other, phrase * 2 + other[:20]]
    engine = make_tp_engine(directory, 2, num_blocks=64, policy="mixed", max_num_batched_tokens=48,
                            speculative=SpeculativeConfig(num_speculative_tokens=3))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    try:
        engine.add_request("r0", prompts[0], params)
        head = [t for o in engine.step() for t in o.new_token_ids]  # r0 decodes; the others' chunks join it
        for i, prompt in enumerate(prompts[1:], 1):
            engine.add_request(f"r{i}", prompt, params)
        outs = run_to_completion(engine.step, [f"r{i}" for i in range(3)])
        assert engine.spec_stats.num_accepted_tokens > 0
    finally:
        engine.close()
    outs[0].token_ids = head + outs[0].token_ids
    for prompt, ours in zip(prompts, outs):
        assert_greedy_matches(hf_model, prompt, ours.token_ids, 20, what="tp 2 speculative")

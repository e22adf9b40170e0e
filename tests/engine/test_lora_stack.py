"""A bfloat16 step with adapters runs the whole decoder stack in one C++ call
(``decoder_layers_lora``, pdserve/engine/kernels/csrc/decoder_lora.cpp) on every kernel path, and
that call is bitwise the layer-by-layer path through the ``LoRALinear`` wrappers: the same
hidden states and the same K/V stored. A sequence's bfloat16 tokens and logprobs under an adapter
are the same alone as in a batch mixing adapters and the base model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.lora.layers import LoRAStack
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import hf_greedy, random_prompts
from tests.families import save_family_model
from tests.helpers.lora import FUSED, lora_engine, make_adapter, merged

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 + FMA")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    """Two random rank-8 adapters (rank 6 for beta: a slot's rows past its rank stay zero) on
    every projection of the tiny Llama: {name: (directory,)}."""
    _, hf = tiny_llama_dir
    out = {}
    for i, (name, rank) in enumerate((("alpha", 8), ("beta", 6))):
        directory = tmp_path_factory.mktemp(f"lora-stack-{name}")
        make_adapter(hf, directory, rank=rank, alpha=2 * rank, seed=20 + i)
        out[name] = (directory,)
    return out


def check_both_ways(engine) -> list[int]:
    """Wrap the model's ``LoRAStack`` so that every step with adapters runs through the one call
    and through the layer loop, each from the cache as it was, and asserts the two agree bit for
    bit; the loop's result goes on. Returns a list that counts the steps checked."""
    runner = engine.runner
    stack = runner.model.stack
    assert isinstance(stack, LoRAStack) and stack.projections is not None
    checked = []
    whole = stack.forward

    def forward(layers, h, rope, ctx):
        if not stack.state.active:
            return whole(layers, h, rope, ctx)
        assert stack.packed.runs(layers)
        before = runner.cache.clone()
        fused = whole(layers, h.clone(), rope, ctx)
        fused_cache = runner.cache.clone()
        runner.cache.copy_(before)
        loop = stack.plain(layers, h.clone(), rope, ctx)
        step = f"step {len(checked) + 1} ({ctx.slot_block.numel()} tokens)"
        assert torch.equal(fused[0], loop[0]) and torch.equal(fused[1], loop[1]), f"{step}: hidden states differ"
        assert torch.equal(fused_cache, runner.cache), f"{step}: the stored K/V differ"
        checked.append(ctx.slot_block.numel())
        return loop

    stack.forward = forward
    return checked


@pytest.mark.parametrize("segment_tokens,max_rank", [(0, 8), (1, 8), (20, 9), (0, 16)],
                         ids=["gather-free", "by-slot", "both-odd-rank", "gather-free-blocks"])
def test_the_one_call_is_bitwise_the_layer_loop_on_every_path(tiny_llama_dir, adapter_dirs, kernel_path,
                                                              segment_tokens, max_rank):
    """Prefill (chunked: a small token budget) and decode steps mixing alpha, beta and the base
    model, on each kernel path this processor runs; the one call's products gather-free (every
    slot at once, one expand per part), slot by slot (the form of long steps), and each by the
    step's size at an odd rank (the rank blocks padded to pairs of k where they started odd); at
    rank 16 the gather-free steps on avx512_bf16 run block by block (decoder_lora.h)."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, adapter_dirs, dtype="bfloat16", max_num_batched_tokens=32,
                         max_lora_rank=max_rank)
    assert engine.runner.model.kernel_path == kernel_path
    engine.runner.model.stack.segment_tokens = segment_tokens
    checked = check_both_ways(engine)
    names = ["alpha", "", "beta", "alpha"]
    prompts = random_prompts(len(names), [40, 9, 13, 5], seed=7)
    done = engine.generate(prompts, [SamplingParams(max_tokens=5, ignore_eos=True, lora_name=n) for n in names])
    assert all(len(c.token_ids) == 5 for c in done)
    assert len(checked) >= 6 and max(checked) > len(names)  # prefill chunks and batched decodes


def test_a_sequence_has_the_same_bits_alone_and_in_a_mixed_batch(tiny_llama_dir, adapter_dirs):
    """bfloat16 through the one call: alpha's tokens and logprobs alone equal its row of a batch
    with beta and the base model around it (and alpha changes the answer)."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, adapter_dirs, dtype="bfloat16")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = random_prompts(4, [11, 7, 19, 11], seed=3)
    alpha = dataclasses.replace(params, lora_name="alpha")
    alone = engine.generate([prompts[0]], [alpha])[0]
    batch = engine.generate(prompts, [alpha, dataclasses.replace(params, lora_name="beta"), params,
                                      dataclasses.replace(params, lora_name="beta")])
    assert batch[0].token_ids == alone.token_ids and batch[0].logprobs == alone.logprobs
    base = engine.generate([prompts[0]], [params])[0]
    assert base.token_ids != alone.token_ids or base.logprobs != alone.logprobs


def test_a_fused_checkpoint_module_adapted_whole(tmp_path):
    """Phi-3 holds q|k|v and gate|up fused in its checkpoint, so its adapters adapt them whole (one A
    for every part): float32 greedy tokens equal transformers' with the adapter merged, and
    bfloat16's one call is bitwise the layer loop, gather-free and slot by slot."""
    model_dir, hf = save_family_model("phi3", tmp_path / "phi3")
    adapter = make_adapter(hf, tmp_path / "fused", modules=FUSED, seed=4)
    adapters = {"fused": (tmp_path / "fused",)}
    prompt = [5, 17, 93, 4, 250, 8, 61]
    engine = lora_engine(model_dir, adapters, max_loras=1)
    done = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, lora_name="fused"))
    want = hf_greedy(merged(hf, adapter), prompt, 8)
    assert done[0].token_ids == want and want != hf_greedy(hf, prompt, 8)
    for segment_tokens in (0, 1):
        engine = lora_engine(model_dir, adapters, max_loras=1, dtype="bfloat16")
        engine.runner.model.stack.segment_tokens = segment_tokens
        checked = check_both_ways(engine)
        engine.generate([prompt, prompt[:3]], [SamplingParams(max_tokens=3, ignore_eos=True, lora_name=n)
                                              for n in ("fused", "")])
        assert len(checked) >= 3



def test_the_one_call_names_the_lists_a_step_lacks(tiny_llama_dir, adapter_dirs):
    """A step takes only its own form's weights (``LoRAStack`` passes the other form's lists
    empty); a call that lacks its own form's lists is refused, naming them, never run on
    missing weights."""
    model_dir, _ = tiny_llama_dir
    engine = lora_engine(model_dir, adapter_dirs, dtype="bfloat16")
    stack = engine.runner.model.stack
    errors, whole = [], stack.forward

    def forward(layers, h, rope, ctx):
        if stack.state.active and not errors:
            shrink, expand, shrink_slots, expand_slots = stack._weights()
            for lists, segment_tokens in (((shrink, expand, [], []), 1), (([], [], shrink_slots, expand_slots), 0)):
                try:
                    torch.ops.pdserve.decoder_layers_lora(*stack.packed.arguments(layers, h.clone(), rope, ctx),
                                                          *lists, stack.parts, stack.part_sizes, stack.rank,
                                                          stack.state.mask, segment_tokens)
                    errors.append(None)
                except RuntimeError as exc:
                    errors.append(str(exc))
        return whole(layers, h, rope, ctx)

    stack.forward = forward
    done = engine.generate([[5, 17, 93]], SamplingParams(max_tokens=2, ignore_eos=True, lora_name="alpha"))
    assert len(done[0].token_ids) == 2
    assert len(errors) == 2 and None not in errors
    assert "lora_shrink_slots and lora_expand_slots need" in errors[0]  # slot by slot without them
    assert "lora_shrink needs 4 entries per layer" in errors[1]  # gather-free without its lists

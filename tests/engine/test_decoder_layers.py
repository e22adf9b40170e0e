"""The whole bfloat16 decoder stack in one call (pdserve/engine/kernels/csrc/decoder.cpp) is bitwise the
layer-by-layer path it replaces, for every kind of step (prefill, chunked prefill, decode, a
mix), with q/k/v bias (Qwen2) and without, and it writes the same K/V into the cache."""

import pytest
import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.linear import PackedDecoderStack
from pdserve.engine.models.decoder import DecoderStack
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, make_hf_model, random_prompts, save_hf_model

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 + FMA")


def forward_both_ways(engine, out):
    """The step's forward through the fused stack and through the layer loop, each on its own
    copy of the cache as it was before the step: (hidden, cache) for each."""
    runner = engine.runner
    model = runner.model
    fused = model.stack
    assert isinstance(fused, PackedDecoderStack)
    before = runner.cache.clone()
    results = []
    for stack in (fused, DecoderStack()):
        runner.cache.copy_(before)
        model.stack = stack
        input_ids, positions, ctx, _ = runner.prepare(out)
        model.bind_caches(runner._layer_caches, runner.backend)
        with torch.inference_mode():
            results.append((model(input_ids, positions, ctx), runner.cache.clone()))
    model.stack = fused
    return results


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_decoder_layers_is_bitwise_the_layer_loop_for_every_step_kind(tmp_path, model_type):
    model_dir = save_hf_model(make_hf_model(model_type), tmp_path / model_type)
    # A small token budget chunks the long prompt; "b" and "c" join while "a" decodes.
    engine = make_engine(model_dir, dtype="bfloat16", max_num_batched_tokens=48)
    kinds = []
    run = engine.runner.run

    def checked_run(out):
        kinds.append("prefill" if out.is_prefill else "decode")
        (fused_h, fused_cache), (loop_h, loop_cache) = forward_both_ways(engine, out)
        assert torch.equal(fused_h, loop_h), f"step {len(kinds)} ({kinds[-1]}): hidden states differ"
        assert torch.equal(fused_cache, loop_cache), f"step {len(kinds)} ({kinds[-1]}): the stored K/V differ"
        return run(out)

    engine.runner.run = checked_run
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = random_prompts(3, [5, 70, 17], seed=4)
    engine.add_request("a", prompts[0], params)
    for step in range(60):
        if step == 2:
            engine.add_request("b", prompts[1], params)
            engine.add_request("c", prompts[2], params)
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert kinds.count("prefill") >= 3 and kinds.count("decode") >= 5  # a chunked prompt, and batched decodes


def test_attention_other_than_paged_runs_the_layers_one_by_one(tmp_path):
    """sdpa has no fused call: the packed stack hands the step to the layer loop."""
    model_dir = save_hf_model(make_hf_model("llama"), tmp_path / "m")
    prompt = random_prompts(1, [9], seed=1)[0]
    outputs = []
    for stack in ("packed", "loop"):
        engine = make_engine(model_dir, dtype="bfloat16", attention_backend="sdpa")
        assert isinstance(engine.runner.model.stack, PackedDecoderStack)
        if stack == "loop":
            engine.runner.model.stack = DecoderStack()
        outputs.append(engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids)
    assert len(outputs[0]) == 5
    assert outputs[0] == outputs[1]

"""A step's progress shows layer by layer (pdserve/engine/progress.py), on both paths a CPU
step takes: the bfloat16 whole-stack kernel call and the float32 layer loop. The router's
liveness reads it, so that one long prefill step on a slow core is not taken for a hang."""

import pytest

from pdserve.engine import progress
from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.linear import PackedDecoderStack
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, make_hf_model, random_prompts, save_hf_model

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported(), reason="needs an x86-64 CPU with AVX2 + FMA")


@pytest.mark.parametrize("dtype,fused", [("bfloat16", True), ("float32", False)])
def test_every_step_advances_the_count_by_its_layers(tmp_path, dtype, fused):
    hf = make_hf_model("llama")
    layers = hf.config.num_hidden_layers
    engine = make_engine(save_hf_model(hf, tmp_path / "m"), dtype=dtype)
    assert isinstance(engine.runner.model.stack, PackedDecoderStack) is fused
    engine.add_request("a", random_prompts(1, [9], seed=1)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    counts = [progress.layers_done()]
    while engine.has_unfinished():
        engine.step()
        counts.append(progress.layers_done())
    steps = [after - before for before, after in zip(counts, counts[1:])]
    assert steps == [layers] * len(steps) and len(steps) == 3  # the prefill step, then two decode steps

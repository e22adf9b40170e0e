"""Every family beyond Llama on the check's device (issue 42): small random-weight Qwen3,
Qwen3-MoE, Phi-3 and DeepSeek (V2-Lite and V3: MLA over the latent cache, DeepSeek's MoE)
models, the same ones `make test` checks on the CPU, against transformers on the same device,
float32 greedy token for token (near ties aside), through chunked prefill."""

import pytest

from pdserve.engine.sampling.params import SamplingParams
from tests.deepseek_models import make_deepseek
from tests.factories import make_engine, random_prompts, save_hf_model
from tests.families import make_family_model
from tests.helpers.device_checks import assert_device_greedy

pytestmark = pytest.mark.cuda

MAX_TOKENS = 16
MODELS = {
    "qwen3": lambda: make_family_model("qwen3"),
    "qwen3-moe": lambda: make_family_model("qwen3-moe"),
    "phi3": lambda: make_family_model("phi3"),
    "deepseek-v2-lite": lambda: make_deepseek("v2-lite"),
    "deepseek-v3": lambda: make_deepseek("v3"),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_float32_equals_transformers(family, device, tmp_path):
    hf = MODELS[family]()
    directory = save_hf_model(hf, tmp_path / family)
    engine = make_engine(directory, dtype="float32", device=device.type, max_num_batched_tokens=32)
    prompts = random_prompts(3, [5, 40, 90], seed=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    hf = hf.to(device).eval()
    for prompt, out in zip(prompts, outs):
        assert_device_greedy(hf, prompt, out.token_ids, f"{family} ({engine.runner.backend.name}), "
                                                        f"a {len(prompt)}-token prompt")
    assert engine.num_free_blocks == engine.blocks.num_blocks

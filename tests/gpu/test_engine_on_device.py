"""The engine on the check's device against transformers on the same device (part 2 of
scripts/gpu_check.sh): float32 token for token (near ties aside, as tests.factories
explains), bfloat16 logprob-close, on every attention backend present, through chunked
prefill, a prefix-cache hit and a preemption. The Triton paged kernel (``auto``'s choice on
CUDA where triton imports) is checked by name as well. Never run on a GPU where it was written."""

import pytest
import torch

from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine
from tests.gpu.smol import check_device, reference
from tests.helpers.device_checks import PROMPTS, assert_bf16_close, assert_device_greedy

pytestmark = pytest.mark.cuda

MAX_TOKENS = 24


def _flash_present() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return check_device().type == "cuda"


def _triton_present() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backends(dtype: str) -> list[tuple[str, int]]:
    """(attention backend, block size) worth checking here for ``dtype``."""
    if check_device().type != "cuda":
        return [("auto", 16)]
    out = [("auto", 16), ("sdpa", 16)] + ([("triton", 16)] if _triton_present() else [])
    if dtype != "float32" and _flash_present():
        out += [("flash", 16), ("flash", 256), ("flash_invariant", 256)]
    return out


def _engine(smol_dir, device, dtype, backend, block_size, **scheduler):
    return make_engine(smol_dir, dtype=dtype, device=device.type, attention_backend=backend,
                       block_size=block_size, num_blocks=scheduler.pop("num_blocks", 512), **scheduler)


@pytest.fixture(scope="module")
def hf32(smol_dir, device):
    return reference(smol_dir, torch.float32, device)


@pytest.mark.parametrize("backend,block_size", backends("float32"))
def test_float32_equals_transformers(smol_dir, device, hf32, backend, block_size):
    engine = _engine(smol_dir, device, "float32", backend, block_size, max_num_batched_tokens=64)
    assert engine.runner.backend.name != "flash"  # flash-attn takes no float32
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert_device_greedy(hf32, prompt, out.token_ids, f"{backend}/{block_size}, prompt of {len(prompt)}")


def test_float32_after_a_prefix_hit_equals_transformers(smol_dir, device, hf32):
    engine = _engine(smol_dir, device, "float32", "auto", 16, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    shared = PROMPTS[3][:256]
    engine.generate([shared + [40, 41]], params)
    hits = engine.blocks.prefix_hits
    [out] = engine.generate([shared + [50, 51, 52]], params)
    assert engine.blocks.prefix_hits > hits
    assert_device_greedy(hf32, shared + [50, 51, 52], out.token_ids, "after a prefix hit")


def test_float32_through_a_preemption_equals_transformers(smol_dir, device, hf32):
    """Six prompts of 100 tokens and 30 blocks of 16: four run, and as they cross into their
    eighth block some must give theirs up and be recomputed later."""
    engine = _engine(smol_dir, device, "float32", "auto", 16, num_blocks=30, max_num_batched_tokens=128)
    batch = [[3 + (11 * i + 29 * k) % 256 for i in range(100)] for k in range(6)]
    outs = engine.generate(batch, SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    for k, (prompt, out) in enumerate(zip(batch, outs)):
        assert_device_greedy(hf32, prompt, out.token_ids, f"preempted batch, prompt {k}")


@pytest.mark.parametrize("backend,block_size", backends("bfloat16"))
def test_bfloat16_logprobs_are_close_to_transformers(smol_dir, device, hf32, backend, block_size):
    hf = reference(smol_dir, torch.bfloat16, device)
    engine = _engine(smol_dir, device, "bfloat16", backend, block_size, max_num_batched_tokens=64)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True))
    assert_bf16_close(hf32, hf, PROMPTS, outs, f"{backend}/{block_size}")

"""flash-attn backend against SDPA on the same cache. Runs only where CUDA and flash-attn are."""

import pytest
import torch

from tests.factories import make_engine, random_prompts
from engine.sampling import SamplingParams

pytestmark = pytest.mark.cuda

def _flash_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


requires_cuda = pytest.mark.skipif(not _flash_ready(), reason="needs a CUDA device and flash-attn")


@requires_cuda
@pytest.mark.parametrize("block_size", [16, 256])  # gathered path and flash-attn's paged path
def test_flash_matches_sdpa_greedy(tiny_llama_dir, block_size):
    directory, _ = tiny_llama_dir
    prompts = random_prompts(5, [3, 40, 130, 300, 17], seed=11)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = {}
    for backend in ("sdpa", "flash"):
        engine = make_engine(directory, dtype="bfloat16", device="cuda", attention_backend=backend,
                             block_size=block_size, num_blocks=64, max_num_batched_tokens=64)
        assert engine.runner.backend.name == backend
        outs[backend] = [c.token_ids for c in engine.generate(prompts, params)]
    assert outs["flash"] == outs["sdpa"]

"""The attention backend choice sees the dtype: flash-attn takes only float16 and bfloat16,
so ``auto`` on CUDA with flash-attn present must not pick it for a float32 model (issue 26:
``--dtype float32`` on an H100 failed at its first step). Where triton imports, ``auto`` on
CUDA takes its paged kernel, for every dtype (issue 43). CUDA, flash-attn and triton's
presence are faked: the choice is plain Python, and no kernel runs."""

import pytest
import torch

import pdserve.engine.attention.flash as attention_flash
import pdserve.engine.attention.select as attention_select
from pdserve.engine.attention.select import select_backend

CUDA = torch.device("cuda")


class FakeFlash:
    name = "flash"

    def __init__(self, num_heads, num_kv_heads, head_dim, block_size, batch_invariant=False, scale=None):
        self.name = "flash_invariant" if batch_invariant else "flash"
        self.scale = head_dim ** -0.5 if scale is None else scale


@pytest.fixture
def flash_present(monkeypatch):
    """flash-attn on CUDA, and no triton (which ``auto`` would take first)."""
    monkeypatch.setattr(attention_flash, "flash_available", lambda device: device.type == "cuda")
    monkeypatch.setattr(attention_flash, "FlashAttention", FakeFlash)
    monkeypatch.setattr(attention_select, "triton_available", lambda device: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_auto_picks_triton_on_cuda_where_it_imports(flash_present, monkeypatch, dtype):
    pytest.importorskip("triton")
    monkeypatch.setattr(attention_select, "triton_available", lambda device: device.type == "cuda")
    assert select_backend("auto", CUDA, 9, 3, 64, 16, dtype=dtype).name == "triton"
    assert select_backend("flash", CUDA, 9, 3, 64, 16, dtype=torch.bfloat16).name == "flash"  # still there, named


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_auto_picks_flash_for_half_dtypes(flash_present, dtype):
    assert select_backend("auto", CUDA, 4, 2, 16, 16, dtype=dtype).name == "flash"


def test_auto_picks_sdpa_for_float32_even_with_flash(flash_present):
    assert select_backend("auto", CUDA, 4, 2, 16, 16, dtype=torch.float32).name == "sdpa"


def test_auto_without_a_dtype_never_picks_flash(flash_present):
    assert select_backend("auto", CUDA, 4, 2, 16, 16).name == "sdpa"


@pytest.mark.parametrize("name", ["flash", "flash_invariant"])
def test_asking_for_flash_in_float32_names_the_dtype(flash_present, name):
    with pytest.raises(ValueError, match="float16 or bfloat16.*float32"):
        select_backend(name, CUDA, 4, 2, 16, 256, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_passes_the_cache_dtype(monkeypatch, dtype):
    """The model runner builds the engine's backend (through ``select_attention``, which rank 0
    and the follower ranks share) and hands ``select_backend`` the cache's dtype."""
    import pdserve.engine.attention.select as attention_select
    import pdserve.engine.runner.model_runner as model_runner
    from pdserve.engine.core.block_manager import BlockManager
    from pdserve.engine.config import ModelConfig

    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return select_backend("sdpa", *args[1:], **kwargs)

    monkeypatch.setattr(attention_select, "select_backend", spy)
    cfg = ModelConfig("llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False)
    cache = torch.zeros(4, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)  # the engine's layout
    model_runner.ModelRunner(None, cfg, cache, BlockManager(4, 16))
    assert seen["dtype"] is dtype
    assert seen["scale"] is None  # the config says none: head_dim ** -0.5


def tiny_config(**fields):
    from pdserve.engine.config import ModelConfig

    return ModelConfig("llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, **fields)


@pytest.mark.parametrize("name,device,dtype", [("sdpa", "cpu", torch.float32), ("auto", "cpu", torch.float32),
                                               ("auto", "cuda", torch.bfloat16), ("auto", "cuda", torch.float32)])
def test_every_backend_takes_the_model_softmax_scale(flash_present, name, device, dtype):
    """``cfg.attention_scale`` (Granite's attention_multiplier) reaches the backend ``select_attention``
    builds, whichever it is; a config without one gets the very float ``head_dim ** -0.5`` the
    backends computed for themselves before the field existed."""
    from pdserve.engine.attention.select import select_attention
    from pdserve.engine.parallel import SINGLE

    device = torch.device(device)
    default = select_attention(name, tiny_config(), SINGLE, device, 16, dtype)
    assert default.scale == 16 ** -0.5 and type(default.scale) is float
    scaled = select_attention(name, tiny_config(attention_scale=0.0078), SINGLE, device, 16, dtype)
    assert (type(scaled), scaled.scale) == (type(default), 0.0078)


def test_triton_takes_the_model_softmax_scale(flash_present, monkeypatch):
    pytest.importorskip("triton")
    from pdserve.engine.attention.select import select_attention
    from pdserve.engine.parallel import SINGLE

    monkeypatch.setattr(attention_select, "triton_available", lambda device: device.type == "cuda")
    backends = [select_attention("auto", tiny_config(**scale), SINGLE, CUDA, 16, torch.float32)
                for scale in ({}, {"attention_scale": 0.0078})]
    assert [(b.name, b.scale) for b in backends] == [("triton", 16 ** -0.5), ("triton", 0.0078)]

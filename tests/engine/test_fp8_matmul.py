"""FP8 weights kept as FP8 (pdserve/engine/linear.py ``TorchBackend(fp8=True)``, ``Fp8Linear``;
pdserve/engine/weights.py ``keep_fp8``), everything of it that needs no GPU. On a CUDA device
with FP8 matmuls the loader keeps each projection's e4m3 weight and a float32 scale per output
row, and ``torch._scaled_mm`` computes; here the same backend is chosen by hand (torch's CPU
build runs ``_scaled_mm`` too), so these tests check which layers get the FP8 module, what they
hold (1 byte a weight, 4 a row), each tensor-parallel rank's share, and that the tokens' logprobs
stay close to the dequantized model's. tests/gpu/test_fp8_on_device.py compares the two paths
on the device; tests/engine/test_fp8.py is the dequantizing path."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine import loader
from pdserve.engine.linear import Fp8Linear, TorchBackend, fp8_matmuls
from pdserve.engine.models import registry
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.sampling.params import SamplingParams
from tests.deepseek_models import make_deepseek
from tests.factories import make_engine, make_hf_model, random_prompts
from tests.gpu.smol import teacher_forced_logprobs
from tests.helpers.fp8 import save_fp8

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# A token's logprob under FP8 weights and activations against float32 on the dequantized
# weights. On this tiny model (large activations: its init is scaled up) bfloat16 on the
# dequantized weights is off by at most 0.05; FP8 activations (3 bits of mantissa, a scale a
# row) by up to 0.6 at a token and about 0.1 on average (measured: 0.35-0.58 max, seeds 31).
# Bounds that a wrong scale, a transposed weight or a dropped row would break by far.
LOGPROB_MEAN_TOL, LOGPROB_MAX_TOL = 0.25, 1.0


@pytest.fixture
def fp8_backend(monkeypatch):
    """The loader picks the FP8-keeping backend, as it does on a CUDA device with FP8 matmuls."""
    monkeypatch.setattr(loader, "select_backend", lambda dtype, device: TorchBackend(fp8=True))


@pytest.fixture(scope="module", params=["tensor", "row"])
def llama_fp8(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"llama-fp8-{request.param}")
    hf, _ = save_fp8(make_hf_model("llama", seed=31), directory, request.param)
    return directory, hf


def fp8_layers(model) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def test_the_projections_keep_one_byte_a_weight_and_a_scale_a_row(fp8_backend, llama_fp8):
    directory, hf = llama_fp8
    engine = make_engine(directory, dtype="bfloat16")
    model = engine.runner.model
    assert model.linear_backend == "torch+fp8"
    layers = fp8_layers(model)
    assert sorted(layers) == sorted(f"layers.{i}.{part}.{p}" for i in range(hf.config.num_hidden_layers)
                                    for part, p in [("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                                    ("mlp", "gate_up_proj"), ("mlp", "down_proj")])
    for layer in layers.values():
        n, k = layer.out_features, layer.in_features
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.nbytes == n * k
        assert layer.scale.dtype == torch.float32 and layer.scale.nbytes == 4 * n
    # Nothing else became float8: the embedding, the norms and the LM head stay bfloat16.
    others = [t for name, t in model.state_dict().items() if not any(p in name for p in PROJECTIONS)]
    assert others and all(t.dtype == torch.bfloat16 for t in others)
    # Each weight is the checkpoint's own float8 value times its row's scale: q's rows of layer 0.
    q = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    qkv = layers["layers.0.self_attn.qkv_proj"]
    torch.testing.assert_close(qkv.weight[:q.shape[0]].float() * qkv.scale[0, :q.shape[0], None], q,
                               rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["tensor", "row"])
def test_an_fp8_linear_is_its_quantized_product_to_bfloat16_rounding(layout):
    """What FP8 matmuls owe, exactly: the product of the e4m3 activations (each row scaled to
    e4m3's largest) and the e4m3 weights, scaled back per row and column, to bfloat16's rounding of
    the result (accumulation order aside). The model-level bounds below are loose only because
    the quantization itself moves the logits; this one is not."""
    from tests.helpers.fp8 import E4M3_MAX, quantize

    torch.manual_seed(5)
    weight = torch.randn(64, 96) * 0.05
    w8, scale = quantize(weight, layout)
    layer = torch.nn.Linear(96, 64, bias=False).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(w8, requires_grad=False)
    layer.weight_scale = scale.expand(64).clone() if layout == "tensor" else scale.reshape(64)
    fp8 = Fp8Linear(layer)
    x = (torch.randn(2, 7, 96) * torch.logspace(-2, 1, 7)[:, None]).to(torch.bfloat16)  # rows of every size
    x2 = x.reshape(-1, 96).float()
    sx = x2.abs().amax(1, keepdim=True) / E4M3_MAX
    xq = (x2 / sx).to(torch.float8_e4m3fn).float() * sx  # what the layer multiplies, in float32
    want = xq @ (w8.float() * fp8.scale.reshape(-1, 1)).t()
    got = fp8(x).float().reshape(-1, 64)
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-5)


def test_fp8_tokens_are_logprob_close_to_the_dequantized_weights(fp8_backend, llama_fp8):
    directory, hf = llama_fp8
    engine = make_engine(directory, dtype="bfloat16")
    prompts = random_prompts(3, [5, 17, 40], vocab=hf.config.vocab_size, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    errors = []
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        truth = teacher_forced_logprobs(hf, prompt, out.token_ids)  # float32 on the dequantized weights
        for i, (token, ours) in enumerate(zip(out.token_ids, out.logprobs)):
            assert token in truth[i].topk(5).indices.tolist(), f"token {i} is not in the float32 top 5"
            errors.append(abs(ours - float(truth[i, token])))
    assert sum(errors) / len(errors) < LOGPROB_MEAN_TOL and max(errors) < LOGPROB_MAX_TOL, errors


def test_block_wise_fp8_stays_dequantized(fp8_backend, tmp_path):
    """DeepSeek-V3's block-wise scales do not fit a scale per row: those weights are dequantized
    as they load, whatever the backend."""
    save_fp8(make_deepseek("v3", seed=19), tmp_path, "block")
    engine = make_engine(tmp_path, dtype="bfloat16")
    assert not fp8_layers(engine.runner.model)
    assert all(t.dtype != torch.float8_e4m3fn for t in engine.runner.model.state_dict().values())


def test_each_rank_keeps_its_share_of_the_float8_weights_and_their_scales(tmp_path):
    """Two ranks' q|k|v (column-parallel: their rows and those rows' scales) and down_proj
    (row-parallel: their columns and every row's scale) from a per-row checkpoint."""
    from pdserve.engine.weights import keep_fp8, load_checkpoint

    hf, _ = save_fp8(make_hf_model("llama", seed=21), tmp_path, "row")
    cfg = registry.model_config_from_hf(json.loads((tmp_path / "config.json").read_text()), "fp8")
    whole = hf.state_dict()
    for rank in (0, 1):
        with torch.device("meta"):
            net = registry.build_model(cfg, TensorParallel(rank, 2))
        tensors = loader.checkpoint_tensors(tmp_path, cfg)
        kept = keep_fp8(net, tensors, TorchBackend(fp8=True).fits_fp8)
        assert len(kept) == 4 * cfg.num_layers
        net = net.to_empty(device="cpu")
        assert load_checkpoint(net, tensors) == []
        down = net.layers[0].mlp.down_proj
        want = whole["model.layers.0.mlp.down_proj.weight"].chunk(2, dim=1)[rank]
        assert torch.equal(down.weight.float() * down.weight_scale[:, None], want)
        qkv = net.layers[0].self_attn.qkv_proj
        q = whole["model.layers.0.self_attn.q_proj.weight"].chunk(2)[rank]
        assert torch.equal(qkv.weight[:q.shape[0]].float() * qkv.weight_scale[:q.shape[0], None], q)


def test_fp8_matmuls_are_chosen_only_for_bfloat16_on_cuda():
    assert not fp8_matmuls(torch.bfloat16, torch.device("cpu"))
    assert not fp8_matmuls(torch.float32, torch.device("cuda"))  # float32 is the exact mode: dequantized

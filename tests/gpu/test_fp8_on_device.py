"""FP8 matmuls on the check's device (pdserve/engine/linear.py ``Fp8Linear``): a model of
SmolLM2's width saved as an FP8 checkpoint (every decoder projection e4m3 with a scale per
tensor, or per output row) is served in bfloat16 twice, its projections kept FP8 and computed
by ``torch._scaled_mm`` (what a device of capability 8.9 and up gets by itself) and dequantized
at load; both are compared with transformers in float32 on the dequantized weights, teacher-
forced on each path's own tokens. tests/engine/test_fp8_matmul.py checks the rest on the CPU.
``PDSERVE_CHECK_DEVICE=cpu`` runs this file there too, the FP8 backend chosen by hand (proving
the test, not the device)."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine import loader
from pdserve.engine.linear import Fp8Linear, TorchBackend
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine
from tests.gpu.smol import SMOLLM2_135M, INIT_STD, byte_tokenizer, reference, teacher_forced_logprobs
from tests.helpers.device_checks import PROMPTS
from tests.helpers.fp8 import save_fp8

pytestmark = pytest.mark.cuda

LAYERS = min(4, int(os.environ.get("PDSERVE_CHECK_LAYERS", 4)))  # the dry run shortens the model
# |our logprob - float32's| of each token, on average and at most. This random model's
# activations are large (its init is scaled up so that greedy choices are not coin tosses), and
# FP8 activations (3 bits of mantissa, a scale a row) follow them: on the CPU dry run FP8 was off
# by 0.64-0.65 on average and 2.1-2.9 at most (scales per tensor, per row) where bfloat16 on the
# dequantized weights was off by 0.09-0.10 and 0.26-0.29. A wrong scale, a transposed weight or a
# lost row is off by many nats.
TOLERANCES = {"fp8": (1.2, 5.0), "dequantized": (0.25, 1.0)}  # (mean, max)


@pytest.fixture(scope="module", params=["tensor", "row"])
def fp8_dir(request, tmp_path_factory, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**SMOLLM2_135M, "num_hidden_layers": LAYERS}, initializer_range=INIT_STD)
    directory = tmp_path_factory.mktemp(f"smol-fp8-{request.param}")
    save_fp8(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), directory, request.param)
    byte_tokenizer().save_pretrained(str(directory))
    return directory


def errors(engine, hf) -> list[float]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    out = []
    for prompt, result in zip(PROMPTS, engine.generate(PROMPTS, params)):
        truth = teacher_forced_logprobs(hf, prompt, result.token_ids)
        for i, (token, ours) in enumerate(zip(result.token_ids, result.logprobs)):
            out.append(abs(ours - float(truth[i, token])))
    return out


def test_fp8_matmuls_stay_logprob_close_to_the_dequantized_path(fp8_dir, device, monkeypatch):
    if device.type == "cpu":  # the dry run: the backend a CUDA device of capability 8.9+ gets
        monkeypatch.setattr(loader, "select_backend", lambda dtype, dev: TorchBackend(fp8=True))
    elif torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("no FP8 matmuls on this device (capability below 8.9): FP8 weights are dequantized")
    hf = reference(fp8_dir / "dequantized", torch.float32, device)
    fp8 = make_engine(fp8_dir, dtype="bfloat16", device=device.type)
    model = fp8.runner.model
    assert model.linear_backend == "torch+fp8"
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * LAYERS
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight.device.type == device.type for m in layers)
    fp8_errors = errors(fp8, hf)
    del fp8, model, layers
    monkeypatch.setattr(loader, "select_backend", lambda dtype, dev: TorchBackend(fp8=False))
    plain_errors = errors(make_engine(fp8_dir, dtype="bfloat16", device=device.type), hf)
    for what, errs in (("fp8", fp8_errors), ("dequantized", plain_errors)):
        mean_tol, max_tol = TOLERANCES[what]
        assert sum(errs) / len(errs) < mean_tol and max(errs) < max_tol, (what, errs)

"""The sampler keeps a step on one device (issue 26: on CUDA every sampled request failed,
drawing its uniform on the host against CUDA probabilities, and every grammar applied a host
bitmask to CUDA logits).

This machine has no GPU, so the step's logits live on the ``meta`` device: a second device
type that runs every kernel's shape logic and no arithmetic. ``OneDevice`` fails any torch
call whose tensor arguments sit on two devices (0-dim host scalars aside, which torch itself
accepts), and xgrammar checks its own arguments. What this proves: every tensor the sampler,
the penalties, the filters, the logprob gathers and the grammar mask hand a kernel is on the
logits' device. What it cannot prove: that CUDA kernels accept them, or their values there
(scripts/gpu_check.sh does, on a GPU).
"""

import json

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from pdserve.engine.sampling.grammar import GrammarCompiler, GrammarKind, StructuredOutput
from pdserve.engine.sampling.sampler import Sampler, SamplerRow
from pdserve.engine.sampling.params import SamplingParams

META = torch.device("meta")
V = 64

PARAMS = {
    "greedy": SamplingParams(),
    "unseeded": SamplingParams(temperature=0.8),
    "seeded": SamplingParams(temperature=1.0, seed=7),
    "top_k_p_min_p": SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5,
                                presence_penalty=0.2, logit_bias=((3, 2.0), (5, -1.0)), min_tokens=4,
                                stop_token_ids=(9,)),
    "logprobs": SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3),
    "greedy_logprobs": SamplingParams(logprobs=True),
}


class OneDevice(TorchFunctionMode):
    """Raises on a torch call that mixes devices; counts the calls it saw."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        devices = {t.device for t in leaves if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1:
            raise AssertionError(f"{getattr(func, '__name__', func)} mixes devices {sorted(map(str, devices))}")
        self.calls += 1
        return func(*args, **kwargs)


def _rows(params: SamplingParams, n: int = 3) -> list[SamplerRow]:
    # Prompt of 4 tokens, 2 output tokens: penalties and min_tokens both apply.
    return [SamplerRow(f"s{i}", params, [1, 2, 3, 4, 5 + i, 6], num_prompt_tokens=4) for i in range(n)]


def _meta_logits(n: int) -> torch.Tensor:
    return torch.empty(n, V, device=META)


@pytest.mark.parametrize("name", PARAMS)
def test_a_step_stays_on_the_logits_device(name):
    rows = _rows(PARAMS[name])
    with OneDevice() as mode:
        picked = Sampler(torch.device("cpu")).pick(_meta_logits(len(rows)), rows)
    assert mode.calls > 0  # the mode saw the step
    assert picked.tokens.device == META and picked.tokens.shape == (len(rows),)
    for t in (picked.chosen, picked.top_values, picked.top_ids):
        assert t is None or t.device == META


def test_a_mixed_batch_stays_on_the_logits_device():
    """Greedy, seeded, filtered and penalised rows in one step (the path that scatters
    drawn rows among greedy ones)."""
    rows = [SamplerRow(f"s{i}", p, [1, 2, 3, 4, 5, 6], num_prompt_tokens=4) for i, p in enumerate(PARAMS.values())]
    with OneDevice():
        picked = Sampler(torch.device("cpu")).pick(_meta_logits(len(rows)), rows)
    assert picked.tokens.device == META


def test_the_mode_catches_a_host_tensor_in_a_device_step():
    """The check above can fail: the old sampler's draw (``torch.rand(1, generator=...)``,
    no device) against device probabilities."""
    cdf = _meta_logits(2).cumsum(-1)
    with OneDevice(), pytest.raises(AssertionError, match="mixes devices"):
        torch.searchsorted(cdf, (torch.rand(2) * cdf[:, -1]).unsqueeze(1))


@pytest.fixture(scope="module")
def grammars(tool_llama):
    return GrammarCompiler(tool_llama[1].hf, 49152, [2])


@pytest.fixture
def xgrammar_on_meta(monkeypatch):
    """xgrammar picks torch.compile for a device it does not know; its plain-torch kernel
    keeps its own device check and runs on meta."""
    import xgrammar as xgr

    real = xgr.apply_token_bitmask_inplace
    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace",
                        lambda logits, bitmask, **kw: real(logits, bitmask, backend="torch_native", **kw))


def test_the_grammar_mask_goes_to_the_logits_device(grammars, xgrammar_on_meta):
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    constrained = SamplingParams(temperature=1.0, structured=StructuredOutput(GrammarKind.JSON_SCHEMA, schema))
    rows = [SamplerRow("free", SamplingParams(), [1, 2], num_prompt_tokens=2),
            SamplerRow("json", constrained, [1, 2], num_prompt_tokens=2)]
    sampler = Sampler(torch.device("cpu"))
    sampler.grammars, sampler.eos_token_ids = grammars, frozenset({2})
    with OneDevice():
        picked = sampler.pick(torch.empty(2, 49152, device=META), rows)
    assert picked.tokens.device == META


def test_one_copy_back_gives_the_same_lists():
    """Off the CPU the results travel in one packed copy (``to_host(pack=True)``); packed or
    not, the engine gets the same token ids and logprobs, bit for bit."""
    rows = _rows(PARAMS["logprobs"]) + _rows(PARAMS["greedy_logprobs"], 1)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0))
    picked = Sampler(torch.device("cpu")).pick(logits, rows)
    assert picked.to_host(pack=True) == picked.to_host(pack=False)
    (tokens, chosen, tops, _), usable = picked.to_host(pack=True)
    assert all(isinstance(t, int) for t in tokens) and len(chosen) == len(rows) and usable == [True] * len(rows)
    assert [len(t) for t in tops] == [3, 3, 3, 0]

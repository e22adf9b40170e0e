"""A checkpoint's tensors, read one at a time and only the part a rank keeps.

``CheckpointTensor`` is one named tensor not yet read: its shape, and ``read(dim, start,
length)`` for a slice along one dimension. ``safetensors_tensors(files)`` lists a directory's
tensors from the files' headers without reading any data; a read of rows is one ``pread`` of
exactly those bytes, and a read of columns reads the tensor once and keeps the columns. Nothing
is memory-mapped, so what a process holds while loading is its parameters plus one tensor, not
the checkpoint's pages (safetensors' own ``safe_open`` maps the file, and every page read stays
in the reader's resident set until the file is closed).

The format (safetensors' specification): an 8-byte little-endian header length N, N bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the data, each tensor row-major at ``8 + N + begin``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from pdserve.engine.errors import ModelLoadError

# safetensors' dtype names -> torch's (the ones a language-model checkpoint holds).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class CheckpointTensor:
    """One named tensor of a checkpoint; ``read`` returns (a slice of) it as a CPU tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The whole tensor, or ``length`` entries from ``start`` along ``dim``."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class InMemoryTensor(CheckpointTensor):
    """A tensor already in memory (a state dict handed to ``load_hf_weights``)."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self.tensor = name, tensor
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        if dim is None:
            return self.tensor
        _check_range(self, dim, start, length)
        return self.tensor.narrow(dim, start, self.shape[dim] - start if length is None else length)


@dataclass
class SafetensorsTensor(CheckpointTensor):
    """A tensor inside a .safetensors file, at ``offset`` bytes from the file's start."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    path: Path
    offset: int

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        if dim is None:
            return self._rows(0, self.shape[0] if self.shape else 1).view(self.shape)
        _check_range(self, dim, start, length)
        length = self.shape[dim] - start if length is None else length
        if dim == 0:  # rows are contiguous: read exactly those bytes
            return self._rows(start, length).view((length, *self.shape[1:]))
        return self.read().narrow(dim, start, length).clone()  # one tensor held, then only the slice

    def _rows(self, start: int, count: int) -> torch.Tensor:
        row = self.nbytes // max(1, self.shape[0] if self.shape else 1)
        size = row * count
        buf = bytearray(size)
        view, done = memoryview(buf), 0
        with open(self.path, "rb", buffering=0) as f:
            while done < size:  # one read returns at most about 2 GiB on Linux
                got = os.preadv(f.fileno(), [view[done:]], self.offset + start * row + done)
                if got <= 0:
                    raise ModelLoadError(str(self.path), f"corrupt checkpoint: tensor {self.name} is cut short")
                done += got
        return torch.frombuffer(buf, dtype=self.dtype) if size else torch.empty(0, dtype=self.dtype)


def _check_range(tensor: CheckpointTensor, dim: int, start: int, length: int | None) -> None:
    if dim >= len(tensor.shape) or start < 0 or start + (length or 0) > tensor.shape[dim]:
        raise ValueError(f"tensor {tensor.name}: shape {tensor.shape} has no [{start}:{start + (length or 0)}] "
                         f"along dimension {dim}")


def read_header(path: Path) -> dict:
    """A .safetensors file's JSON header; ``ModelLoadError`` for a file that is not one."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise ModelLoadError(str(path), f"corrupt checkpoint ({exc})") from exc
    header["__data_start__"] = 8 + n
    return header


def safetensors_tensors(files: list[Path]) -> Iterator[SafetensorsTensor]:
    """Every tensor of ``files`` in file order, from the headers alone."""
    for path in files:
        header = read_header(path)
        start, size = header.pop("__data_start__"), path.stat().st_size
        header.pop("__metadata__", None)
        for name, entry in header.items():
            dtype = DTYPES.get(entry.get("dtype"))
            begin, end = entry.get("data_offsets", (0, -1))
            tensor = SafetensorsTensor(name, tuple(entry.get("shape", ())), dtype, path, start + begin) \
                if dtype is not None else None
            if tensor is None or tensor.nbytes != end - begin or start + end > size:
                raise ModelLoadError(str(path), f"corrupt checkpoint: tensor {name} ({entry})")
            yield tensor


class Fp8Tensor(CheckpointTensor):
    """A float8 (e4m3) weight read with its scale, dequantized to float32: ``weight *
    weight_scale`` (one scale, or one per output row), or ``weight * weight_scale_inv`` per
    block of ``block`` (rows, columns) as block-wise checkpoints ship (DeepSeek-V3's). A rank's
    read of some rows or columns dequantizes only those."""

    def __init__(self, weight: CheckpointTensor, scale: CheckpointTensor, block: tuple[int, int] | None):
        self.name, self.shape, self.dtype = weight.name, weight.shape, torch.float32
        self.weight, self.scale, self.block = weight, scale, block

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        w = self.weight.read(dim, start, length).float()
        if dim is None:
            start, length, dim = 0, self.shape[0], 0
        length = self.shape[dim] - start if length is None else length
        return w * self._scales(dim, start, length)

    @property
    def keepable(self) -> bool:
        """Whether the weight can stay float8 with a scale per output row (``read_e4m3``,
        ``row_scales``): e4m3 with a scale per tensor or per row; block-wise scales are not."""
        return self.block is None and self.weight.dtype == torch.float8_e4m3fn

    def read_e4m3(self, dim: int | None = None, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The float8 weight itself (or ``length`` of it from ``start`` along ``dim``), unscaled."""
        return self.weight.read(dim, start, length)

    def row_scales(self, start: int = 0, length: int | None = None) -> torch.Tensor:
        """The float32 scale of each output row in [start, start + length): a per-tensor scale
        repeated, or the rows' own (only where ``keepable``)."""
        rows = self.shape[0]
        length = rows - start if length is None else length
        s = self.scale.read().float().reshape(-1)
        return s.expand(length).clone() if s.numel() == 1 else s[start:start + length].clone()

    def _scales(self, dim: int, start: int, length: int) -> torch.Tensor:
        """The scale of each element of the read (broadcastable to it)."""
        s = self.scale.read().float()
        if s.numel() == 1:
            return s.reshape(())
        rows, cols = self.shape
        if self.block is None:  # one scale per output row
            s = s.reshape(rows, 1)
        else:  # one per (block rows x block columns), the last blocks cut short
            s = s.repeat_interleave(self.block[0], 0)[:rows].repeat_interleave(self.block[1], 1)[:, :cols]
        return s.narrow(dim, start, length) if s.shape[dim] > 1 else s


def with_scales(tensors: list[CheckpointTensor], block: tuple[int, int] | None = None) -> list[CheckpointTensor]:
    """``tensors`` with each float8 weight joined to its ``weight_scale`` (or, block-wise,
    ``weight_scale_inv``) as one ``Fp8Tensor``, and the scales gone from the list. Activation
    scales (``input_scale``: static FP8 activations) are dropped: the weights are dequantized
    and the activations stay in the serving dtype. ``ModelLoadError`` for a float8 weight
    without its scale."""
    by_name = {t.name: t for t in tensors}
    fp8 = {t.name for t in tensors if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}
    # Only a float8 weight's own scales go: any other is a tensor with no place in the model.
    taken = {w + suffix for w in fp8 for suffix in ("_scale", "_scale_inv")}
    taken |= {w.removesuffix(".weight") + ".input_scale" for w in fp8}
    out = []
    for t in tensors:
        if t.name in taken:
            continue
        if t.name in fp8:
            scale = by_name.get(t.name + "_scale_inv" if block else t.name + "_scale")
            if scale is None or len(t.shape) != 2:
                raise ModelLoadError(t.name, f"a float8 weight of shape {t.shape} without its "
                                             f"{'weight_scale_inv' if block else 'weight_scale'}")
            t = Fp8Tensor(t, scale, block)
        out.append(t)
    return out


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """``dst.copy_(src)`` (cast to dst's dtype, moved to its device); ValueError naming the
    checkpoint tensor when the shapes disagree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)

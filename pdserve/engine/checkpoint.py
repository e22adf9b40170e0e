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


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """``dst.copy_(src)`` (cast to dst's dtype, moved to its device); ValueError naming the
    checkpoint tensor when the shapes disagree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)

"""One rank of ``test_tensor_parallel``'s all-reduce check: ``python tp_reduce_probe.py STORE RANK SIZE OUT``.
Each rank sums float32 values that round differently in every order, at several lengths, and
writes what it got for the first elements."""

import sys

import torch

from pdserve.engine.parallel import TensorParallel
from pdserve.engine.distributed.group import join, open_store


def main(store_path: str, rank: int, size: int, out: str) -> None:
    group = join(open_store(store_path, size), rank, size, torch.device("cpu"))
    tp = TensorParallel(rank, size, group)
    values = torch.randn(4096, generator=torch.Generator().manual_seed(rank)) * 10 ** (3 * rank)
    heads = [tp.all_reduce(values[:n].clone())[:16] for n in (16, 17, 1000, 4096)]
    torch.save(torch.stack(heads), out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

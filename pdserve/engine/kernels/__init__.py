"""pdserve's own CPU kernels: the C++ sources (csrc/), compiled once per machine and loaded by
cpu_kernels.py, with the instruction-set path chosen per processor."""

"""Compiles pdserve's Triton kernels (pdserve/engine/attention/triton.py, pdserve/engine/kernels/
triton_fused.py) for a GPU with
Triton's real compiler, down to machine code, on a host without one: what the interpreter
cannot check (tile shapes tl.dot accepts, types, shared memory). Run by
tests/engine/test_triton_attention.py in a process of its own, without TRITON_INTERPRET:

    python -m tests.engine.triton_compile [sm] [attention|others|all]   # default 90 (an H100), all
"""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.engine.attention.triton import _attention_kernel, _store_kv_kernel
from pdserve.engine.attention.triton_split import MAX_SPLITS, SPLIT_MIN_KEYS, _reduce_kernel, _split_kernel
from pdserve.engine.attention.triton_walk import launch_constants
from pdserve.engine.kernels.triton_fused import _rms_norm_kernel, _rotary_kernel, _silu_mul_kernel

HEAD_DIM, BLOCK_SIZE = 64, 16  # SmolLM2's head size, pdserve's block size


def _compile(kernel, types: list[str], constants: dict, target: GPUTarget, options: dict | None = None):
    names = kernel.arg_names
    signature = {n: (types[i] if i < len(types) else "constexpr") for i, n in enumerate(names)}
    return triton.compile(ASTSource(fn=kernel, signature=signature,
                                    constexprs={(names.index(k),): v for k, v in constants.items()}), target=target,
                          options=options)


def _fused(target: GPUTarget) -> list[str]:
    """The fused norm, silu * up and RoPE launches (kernels/triton_fused.py) for SmolLM2's shapes
    (hidden 576, intermediate 1536, 9/3 heads of 64), bfloat16 and float32, as launched: fused
    multiply-adds off, libdevice's exp."""
    done, options = [], {"enable_fp_fusion": False}
    for dtype in ("bf16", "fp32"):
        for residual in (False, True):
            _compile(_rms_norm_kernel, [f"*{dtype}"] * 5 + ["i32", "fp32"] + ["i32"] * 4,
                     dict(HAS_RESIDUAL=residual, BLOCK=1024), target, options)
            done.append(f"rms_norm {dtype}" + (" residual" if residual else ""))
        _compile(_silu_mul_kernel, [f"*{dtype}"] * 2 + ["i32"] * 3, dict(BLOCK=1024, LIBDEVICE=True), target, options)
        _compile(_rotary_kernel, [f"*{dtype}"] * 6 + ["i32"] * 9,
                 dict(NUM_HEADS=9, NUM_KV_HEADS=3, HALF=HEAD_DIM // 2, BLOCK_QH=16, BLOCK_KH=4, BLOCK_HALF=HEAD_DIM // 2),
                 target, options)
        done += [f"silu_mul {dtype}", f"rotary {dtype} 9/3"]
    return done


def main(sm: int = 90, part: str = "all") -> list[str]:
    """``part`` "attention": the engine's decode and prefill launches for SmolLM2's heads (9 query
    heads over 3 KV heads), in bfloat16 and float32, the bfloat16 ones again with a sliding window
    (Gemma 3's local layers: 512 keys); "others": split-KV decode (``_split_kv``), the K/V store and
    the fused elementwise kernels (``_fused``); "all": both, in that order. Returns what compiled.
    (Two processes each compiling a part take about half the time of one compiling all.)"""
    target = GPUTarget("cuda", sm, 32)
    steps = {"attention": (_attention,), "others": (_others,), "all": (_attention, _others)}[part]
    return [line for step in steps for line in step(target)]


def _attention(target: GPUTarget) -> list[str]:
    done = []
    for dtype, torch_dtype, window in (("bf16", torch.bfloat16, None), ("fp32", torch.float32, None),
                                       ("bf16", torch.bfloat16, 512)):
        for max_query_len in (1, 64):
            constants = launch_constants(9, 3, HEAD_DIM, BLOCK_SIZE, max_query_len, torch_dtype, interpreted=False,
                                         window=window)
            strides = len(_attention_kernel.arg_names) - 8 - len(constants)
            types = [f"*{dtype}"] * 4 + ["*i32"] * 3 + ["fp32"] + ["i32"] * strides
            _compile(_attention_kernel, types, constants, target)
            done.append(f"attention {dtype} 9/3 query {max_query_len}" + (f" window {window}" if window else ""))
    return done


def _others(target: GPUTarget) -> list[str]:
    done = _split_kv(target)
    _compile(_store_kv_kernel, ["*bf16"] * 4 + ["*i64"] * 2 + ["i32"] * 10,
             dict(NUM_KV_HEADS=3, HEAD_DIM=HEAD_DIM, BLOCK_H=4, BLOCK_D=HEAD_DIM), target)
    return done + ["store bf16"] + _fused(target)


def _split_kv(target: GPUTarget) -> list[str]:
    """Split-KV decode's two kernels at the most splits, for SmolLM2's heads and for
    Llama-3.1-8B's (32 query heads over 8 KV heads of 128), bfloat16 (with a window too) and
    float32."""
    done = []
    for (nh, nkv, hd), dtype, torch_dtype, window in (((9, 3, HEAD_DIM), "bf16", torch.bfloat16, None),
                                                      ((32, 8, 128), "bf16", torch.bfloat16, None),
                                                      ((32, 8, 128), "fp32", torch.float32, None),
                                                      ((32, 8, 128), "bf16", torch.bfloat16, 512)):
        constants = launch_constants(nh, nkv, hd, BLOCK_SIZE, 1, torch_dtype, interpreted=False, window=window)
        types = [f"*{dtype}"] * 3 + ["*fp32"] * 3 + ["*i32"] * 3 + ["fp32"] + ["i32"] * 10
        _compile(_split_kernel, types, dict(constants, SPLITS=MAX_SPLITS, MIN_KEYS=SPLIT_MIN_KEYS), target)
        _compile(_reduce_kernel, ["*fp32"] * 3 + [f"*{dtype}", "*i32", "i32", "i32"],
                 dict(HEAD_DIM=hd, BLOCK_D=constants["BLOCK_D"], SPLITS=MAX_SPLITS), target)
        done.append(f"split-kv {dtype} {nh}/{nkv}x{hd}" + (f" window {window}" if window else ""))
    return done


if __name__ == "__main__":
    for line in main(*(int(a) if a.isdigit() else a for a in sys.argv[1:])):
        print(line)

"""Kernels of our own for the CUDA backend: CUDA C that CuPy compiles (RawModule, NVRTC), each
with a NumPy twin that states what it computes.

A `DeviceKernel` is one `extern "C" __global__` function: its source, its name, which of its
arguments it writes, and its twin, a NumPy function taking the same arguments in the same order
(device arrays as flat NumPy arrays over the same memory, scalars as NumPy scalars) and writing
the same outputs. The CuPy stand-in (tests/cupy_standin) runs the twin where a GPU would run the
kernel, on the current stream, so every test of the CUDA path runs them in CI; on a GPU,
tests/test_device_kernels.py holds each kernel against its twin. A kernel reads raw memory, so
every array argument must be C-contiguous (the stand-in refuses one that is not, where a GPU
would read the wrong elements).

`compile_all(cupy)` compiles every kernel when a CUDA worker starts (NVRTC takes seconds the
first time; CuPy caches the binaries on disk), so a first prompt is not charged for it and a
kernel that does not compile stops the worker before any weight moves, with a
`KernelCompileError` naming the kernel and the compiler's message.

Adding a kernel: its CUDA C and twin in a module of this folder, a DeviceKernel in that module's
DEVICE_KERNELS, the module in MODULES below, and a test against its twin.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from split_state.errors import KernelCompileError

# the modules whose DEVICE_KERNELS the CUDA backend compiles
MODULES = (
    "workers.backends.cuda.kernels.qgemv",
    "workers.backends.cuda.kernels.dequant",
    "workers.backends.cuda.kernels.set_rows",
    "workers.backends.cuda.kernels.rope",
    "workers.backends.cuda.kernels.get_rows",
    "workers.backends.cuda.kernels.attend",
    "workers.backends.cuda.kernels.prefill_attend",
    "workers.backends.cuda.kernels.rms_norm",
    "workers.backends.cuda.kernels.swiglu",
    "workers.backends.cuda.kernels.top_k",
    "workers.backends.cuda.kernels.sample",
)
OPTIONS = ("--std=c++14",)

# float16 bits to float32 by the PTX instruction: no header (cuda_fp16.h) to find, so the same
# source compiles under NVRTC (CuPy) and nvcc. Compiled for the host (tests/cuda_on_host.py, which
# runs the kernels' own arithmetic on the CPU in CI), the host defines half_to_float instead.
PRELUDE = r"""
typedef unsigned char u8;
/* NVRTC has no math.h: infinity from its bits (CUDA 13's NVRTC refused INFINITY, an H200 found) */
#if (defined(__CUDACC__) || defined(__CUDACC_RTC__)) && !defined(INFINITY)
#define INFINITY __int_as_float(0x7f800000)
#endif
__device__ __forceinline__ float half_at(const u8* p, long stride) {
    unsigned short bits = (unsigned short)p[0] | ((unsigned short)p[stride] << 8);
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
#else
    return half_to_float(bits);
#endif
}
/* float arithmetic rounded one operation at a time (no fused multiply-add), so a kernel's bits
   are its NumPy twin's, which rounds each operation */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float add_rn(float a, float b) { return a + b; }
__device__ __forceinline__ float sub_rn(float a, float b) { return a - b; }
__device__ __forceinline__ float div_rn(float a, float b) { return a / b; }
__device__ __forceinline__ float sqrt_rn(float a) { return sqrtf(a); }
#endif
__device__ __forceinline__ unsigned short half_bits(float f) {  /* rounded to nearest even */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return float_to_half(f);
#endif
}
"""


@dataclass(frozen=True)
class DeviceKernel:
    name: str  # the extern "C" function's name
    source: str  # the CUDA C module holding it (kernels of one source compile together), after PRELUDE
    twin: Callable = field(compare=False)  # twin(*args): the same arguments, NumPy; writes `writes`
    writes: tuple[int, ...]  # the positions of the arguments it writes


def table() -> dict[str, DeviceKernel]:
    """Every device kernel, by name."""
    out: dict[str, DeviceKernel] = {}
    for module in MODULES:
        for kernel in importlib.import_module(module).DEVICE_KERNELS:
            out[kernel.name] = kernel
    return out


def full_source(source: str) -> str:
    return PRELUDE + source


def compile_all(cupy) -> dict[str, Callable]:
    """name -> the compiled kernel (called as `fn(grid, block, args)`), each compiled now: the
    kernels sharing a source in one module (one NVRTC run)."""
    by_source: dict[str, list[str]] = {}
    for kernel in table().values():
        by_source.setdefault(kernel.source, []).append(kernel.name)
    compiled = {}
    for source, names in by_source.items():
        try:
            module = cupy.RawModule(code=full_source(source), options=OPTIONS)
            for name in names:
                compiled[name] = module.get_function(name)
        except Exception as exc:  # CuPy's CompileException, or a driver refusing the binary
            message = " ".join(str(exc).split())[:600]
            raise KernelCompileError(f"device kernels {', '.join(names)} did not compile: {message}") from None
    return compiled

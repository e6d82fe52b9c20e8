"""The CUDA C of our own kernels (workers/backends/cuda/kernels/device.py) compiled for the CPU with the host's
C++ compiler and run thread by thread, so CI checks the kernels' own arithmetic (their block
layouts, shifts and sums) without a GPU; the stand-in runs their NumPy twins instead, and a GPU
test holds the compiled kernels to the twins.

The emulation: CUDA's qualifiers defined away, `__shared__` arrays made static (one thread block
runs at a time), the block's indices globals set before its threads run. Two ways to run a
block's threads:
- one after another (the default, fast): a block's thread rows (threadIdx.y) from the last to the
  first and `__syncthreads()` doing nothing, so a kernel whose row 0 reads, after its one
  barrier, what the other rows stored before it (a reduction over a block's rows, as qgemv's)
  computes what it computes on a GPU;
- `barriers=True`: each thread of a block an OS thread of its own (threadIdx thread-local) and
  `__syncthreads()` a real barrier among them, for a kernel with any number of barriers (the
  attention's reductions); slower, so for small launches.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

HOST_PRELUDE = r"""
#include <cstring>
#include <cmath>
#include <algorithm>
using std::min;
using std::max;
struct dim3_t { unsigned x, y, z; };
static dim3_t blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float half_to_float(unsigned short h) {  /* IEEE binary16 -> binary32 */
    unsigned int sign = (h >> 15) & 1u, exp = (h >> 10) & 31u, man = h & 1023u;
    float v;
    if (exp == 0) v = std::ldexp((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = std::ldexp((float)(man | 1024u), (int)exp - 25);
    return sign ? -v : v;
}
static inline unsigned short float_to_half(float f) {  /* IEEE binary32 -> binary16, nearest even */
    unsigned int x;
    std::memcpy(&x, &f, 4);
    unsigned int sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 255u, man = x & 0x7fffffu;
    if (exp == 255) return (unsigned short)(sign | 0x7c00u | (man ? 0x200u : 0u));
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (unsigned short)(sign | 0x7c00u);
    if (e <= 0) {  /* subnormal or zero: shift the mantissa with its leading one */
        if (e < -10) return (unsigned short)sign;
        man |= 0x800000u;
        unsigned int shift = (unsigned int)(14 - e), half = man >> shift, rest = man & ((1u << shift) - 1u);
        unsigned int mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1u))) half++;
        return (unsigned short)(sign | half);
    }
    unsigned int half = ((unsigned int)e << 10) | (man >> 13), rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half++;  /* may carry into the exponent */
    return (unsigned short)(sign | half);
}
"""

ONE_BY_ONE = r"""
static dim3_t threadIdx;
#define __syncthreads() ((void)0)
"""

THREADED = r"""
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>
static thread_local dim3_t threadIdx;
struct host_barrier {  /* the block's threads wait for each other, generation by generation */
    std::mutex lock;
    std::condition_variable turned;
    int count = 0, waiting = 0;
    unsigned long generation = 0;
    void wait() {
        std::unique_lock<std::mutex> held(lock);
        const unsigned long mine = generation;
        if (++waiting == count) {
            waiting = 0;
            ++generation;
            turned.notify_all();
        } else {
            turned.wait(held, [&] { return generation != mine; });
        }
    }
};
static host_barrier block_barrier;
#define __syncthreads() block_barrier.wait()
"""

THREADED_LAUNCHER = r"""
extern "C" void host_NAME(int gx, int gy, int bx, int by, SIGNATURE) {
    gridDim = {(unsigned)gx, (unsigned)gy, 1u};
    blockDim = {(unsigned)bx, (unsigned)by, 1u};
    for (int grid_y = 0; grid_y < gy; ++grid_y)
        for (int grid_x = 0; grid_x < gx; ++grid_x) {
            blockIdx = {(unsigned)grid_x, (unsigned)grid_y, 0u};
            block_barrier.count = bx * by;
            std::vector<std::thread> threads;
            for (int thread_y = 0; thread_y < by; ++thread_y)
                for (int thread_x = 0; thread_x < bx; ++thread_x)
                    threads.emplace_back([=] {
                        threadIdx = {(unsigned)thread_x, (unsigned)thread_y, 0u};
                        NAME(ARGS);
                    });
            for (auto& thread : threads) thread.join();
        }
}
"""

LAUNCHER = r"""
extern "C" void host_NAME(int gx, int gy, int bx, int by, SIGNATURE) {
    gridDim = {(unsigned)gx, (unsigned)gy, 1u};
    blockDim = {(unsigned)bx, (unsigned)by, 1u};
    for (int grid_y = 0; grid_y < gy; ++grid_y)
        for (int grid_x = 0; grid_x < gx; ++grid_x)
            for (int thread_y = by - 1; thread_y >= 0; --thread_y)
                for (int thread_x = 0; thread_x < bx; ++thread_x) {
                    blockIdx = {(unsigned)grid_x, (unsigned)grid_y, 0u};
                    threadIdx = {(unsigned)thread_x, (unsigned)thread_y, 0u};
                    NAME(ARGS);
                }
}
"""


def launch(library, name, grid, block, args) -> None:
    """Launch `name`'s host build as CuPy launches a kernel: arrays as pointers, NumPy scalars as
    the C types they stand for (int64 long, float64 double, float32 float, others int)."""
    converted = []
    for a in args:
        if isinstance(a, np.ndarray):
            converted.append(a.ctypes.data_as(ctypes.c_void_p))
        elif isinstance(a, np.int64):
            converted.append(ctypes.c_long(int(a)))
        elif isinstance(a, np.float64):
            converted.append(ctypes.c_double(float(a)))
        elif isinstance(a, np.float32):
            converted.append(ctypes.c_float(float(a)))
        else:
            converted.append(ctypes.c_int(int(a)))
    grid = (*grid, 1)
    dims = [ctypes.c_int(v) for v in (grid[0], grid[1], block[0], 1)]
    getattr(library, f"host_{name}")(*dims, *converted)


class HostKernels:
    """A `kernels` table (name -> fn(grid, block, args)) whose launches run a host build's
    kernels: the CUDA backend's launchers run with NumPy as their array module."""

    def __init__(self, library):
        self.library = library

    def __getitem__(self, name):
        return lambda grid, block, args: launch(self.library, name, grid, block, args)


def real_gpu() -> bool:
    """Whether CuPy and a CUDA GPU are here to run the compiled kernels (the GPU tests' condition)."""
    try:
        import cupy

        return hasattr(cupy.cuda, "Stream") and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def build(
    source: str, kernels: dict[str, tuple[str, str]], folder: Path | None = None, barriers: bool = False
) -> ctypes.CDLL:
    """A shared library of `source` (the kernels' module, PRELUDE included) with a launcher
    `host_NAME(gx, gy, bx, by, *args)` for each name -> (C parameter list, argument names);
    `barriers`: each thread of a block a thread of its own (the module docstring)."""
    text = HOST_PRELUDE + (THREADED if barriers else ONE_BY_ONE) + source
    launcher = THREADED_LAUNCHER if barriers else LAUNCHER
    for name, (signature, args) in kernels.items():
        text += launcher.replace("NAME", name).replace("SIGNATURE", signature).replace("ARGS", args)
    folder = Path(folder or tempfile.gettempdir())
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    library = folder / f"cuda_on_host_{digest}.so"
    if not library.exists():
        src = folder / f"cuda_on_host_{digest}.cpp"
        src.write_text(text)
        done = subprocess.run(
            [compiler(), "-O2", "-shared", "-fPIC", "-std=c++14", "-pthread", "-o", str(library), str(src)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode:
            raise RuntimeError(f"the kernels did not compile for the host:\n{done.stderr[-3000:]}")
    return ctypes.CDLL(str(library))

"""Backends: what a worker computes with. One module (or package) per backend in this folder, found
by name.

A backend module `workers/backends/NAME.py` defines a class `Backend` that provides:

    name: str                       # NAME, as the command line spells it
    kind: str                       # "cpu" or "gpu"
    priority: int                   # `auto` picks the highest-priority backend that has devices
    host_threads: bool              # computes on host cores: CPU workers split the cores (BLAS threads)
    device_count() -> int           # classmethod: devices this machine has (0: unusable here)
    default_workers() -> int        # classmethod: workers to start when the user names none
    Backend(index)                  # drive device `index`
    xp                              # the array module kernels are written against (NumPy's API)
    info() -> DeviceInfo            # name, description and memory figures of the device
    to_device(host array) -> array  # a device array holding a copy of a host array
    to_host(array) -> host array    # a host copy, ordered after every kernel already issued
    synchronize()                   # wait for every kernel issued on this worker's device

and may provide `resident(host array) -> array`: the copy a worker keeps of a tensor it is sent
(without it, `to_device` of a copy; the CPU backend's starts where its products read fastest:
workers/backends/cpu/placement.py), and
`device_sampler(rule, rng, steps, recent, values, indices, tokens, positions)`: a worker-driven
decode loop's sampler on the device (workers/backends/cuda/kernels/sample.py DeviceSampler), or
None where it cannot serve those arrays; without it the loop chooses on the host. A sampler's
backend also has `read_later(array)`: a copy to the host issued behind the work issued so far,
and a function that waits for it (the loop issues the next step before it waits).

Kernels (workers/kernels) use only NumPy-API calls on `xp`: elementwise ufuncs, matmul,
reductions with `axis`/`keepdims`, `astype`, `reshape`/`transpose`/`concatenate`, basic and
boolean indexing, `zeros`/`empty`. Adding a backend is one file here plus tests; every command's
choices come from `names()`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass

from split_state.errors import TransportError


@dataclass(frozen=True)
class DeviceInfo:
    backend: str
    index: int
    name: str
    description: str
    kind: str  # "cpu" or "gpu"
    memory_total: int
    memory_free: int


@functools.cache
def names() -> tuple[str, ...]:
    """Every backend module in this package, by name."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def backend_class(name: str) -> type:
    if name not in names():
        raise TransportError(f"unknown backend {name!r}; choose one of {', '.join(names())}")
    return importlib.import_module(f"{__name__}.{name}").Backend


def make_backend(name: str, index: int = 0, rank: int = 0):
    """Backend `name` driving device `index` (-1: the rank's turn round the devices here)."""
    cls = backend_class(name)
    if index < 0:
        index = rank % max(1, cls.device_count())
    if cls.device_count() <= index:
        raise TransportError(f"backend {name!r} device {index} is not available on this machine")
    return cls(index)


def auto() -> str:
    """The highest-priority backend that has a device here."""
    usable = [cls for cls in map(backend_class, names()) if cls.device_count() > 0]
    return max(usable, key=lambda cls: cls.priority).name


def describe() -> list[dict]:
    """What a coordinator needs to know of each backend on this host, as plain values (it asks
    a `python -m workers --backends` process rather than importing the workers)."""
    out = []
    for name in names():
        cls = backend_class(name)
        count = cls.device_count()
        out.append(
            {
                "name": name,
                "priority": cls.priority,
                "host_threads": cls.host_threads,
                "device_count": count,
                "default_workers": cls.default_workers() if count else 0,
            }
        )
    return out


def registry() -> list[DeviceInfo]:
    """Every backend's devices, as ggml's backend registry lists them."""
    out = []
    for name in names():
        cls = backend_class(name)
        out += [cls(i).info() for i in range(cls.device_count())]
    return out

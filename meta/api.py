"""The Python API: a connected MetaDevice in a `with` block.

with launch.cluster(workers=4, backend="cpu") as dev:
    ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meta.cluster import ClusterConfig, ProcessCluster
from meta.device import MetaDevice
from meta.launchers import blas_threads
from split_state.errors import MetaError
from workers import backends


@contextlib.contextmanager
def cluster(
    workers: int | None = None,
    backend: str = "auto",
    devices: tuple[int, ...] = (),
    debug: bool = False,
    **config,
) -> Iterator[MetaDevice]:
    """Start workers, connect them, yield the MetaDevice; every process is stopped on exit.

    backend: a name from workers.backends (`auto`: the highest-priority one with devices here).
    workers: default one per device of the backend (CPU: 2); devices: device index per worker.
    """
    backend = backends.auto() if backend == "auto" else backend
    cls = backends.backend_class(backend)
    if cls.device_count() == 0:
        raise MetaError(
            f"--backend {backend}: no device is visible (is its package installed? pip install -e '.[{backend}]')"
        )
    if workers is None:
        workers = len(devices) or cls.default_workers()
    if cls.host_threads:
        config.setdefault("blas_threads", blas_threads(workers))
    dev = MetaDevice(
        ProcessCluster(ClusterConfig(workers=workers, backend=backend, devices=tuple(devices), **config)), debug=debug
    )
    try:
        yield dev
    finally:
        dev.close()

"""The Python API: a connected MetaDevice in a `with` block.

with launch.cluster(workers=4, backend="cpu") as dev:
    ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meta.backends import resolve
from meta.cluster import ClusterConfig, ProcessCluster
from meta.device import MetaDevice
from meta.launchers import blas_threads


@contextlib.contextmanager
def cluster(
    workers: int | None = None,
    backend: str = "auto",
    devices: tuple[int, ...] = (),
    debug: bool = False,
    **config,
) -> Iterator[MetaDevice]:
    """Start workers, connect them, yield the MetaDevice; every process is stopped on exit.

    backend: a name from workers/backends/ (`auto`: the highest-priority one with devices here).
    workers: default one per device of the backend (CPU: 2); devices: device index per worker.
    """
    chosen = resolve(backend)  # asked of the workers: meta does not import them
    if workers is None:
        workers = len(devices) or chosen.default_workers
    if chosen.host_threads:
        config.setdefault("blas_threads", blas_threads(workers))
    cluster_config = ClusterConfig(workers=workers, backend=chosen.name, devices=tuple(devices), **config)
    dev = MetaDevice(ProcessCluster(cluster_config), debug=debug)
    try:
        yield dev
    finally:
        dev.close()

"""Batch launchers (Slurm, Open MPI, PMI, torchrun): who am I, how many are we, where is rank 0.

Pure functions of an environment mapping; launch.py passes os.environ (the environment is read
there only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """What a batch launcher tells a process: its rank, the world size and where rank 0 is."""

    source: str
    rank: int
    world_size: int
    coordinator: str = ""  # host of rank 0, when the launcher says
    port: int = 0
    job: str = ""  # the job's (step's) id, where the launcher gives one: names what its ranks share
    one_host: bool = False  # every rank runs on this host, as the launcher says


# per launcher: the variables naming the job, and the local and total rank counts
_JOB_VARS = {
    "torchrun": (("TORCHELASTIC_RUN_ID",), "LOCAL_WORLD_SIZE"),
    "openmpi": (("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"), "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "pmi": (("PMIX_NAMESPACE", "PMI_KVSNAME"), "MPI_LOCALNRANKS"),
    "slurm": (("SLURM_JOB_ID",), "SLURM_STEP_TASKS_PER_NODE"),
}


PROBES = (
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
)


def detect_launcher(env: Mapping[str, str]) -> LaunchEnv | None:
    """Slurm, Open MPI, PMI (MPICH, Intel MPI) or torchrun, from their environment variables."""
    for source, rank_var, size_var in PROBES:
        if rank_var in env and size_var in env:
            host = env.get("MASTER_ADDR", "")
            if not host and source == "slurm":
                host = first_slurm_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
            size = int(env[size_var])
            job_vars, local_var = _JOB_VARS[source]
            job = next((env[v] for v in job_vars if env.get(v)), "")
            if source == "slurm" and job:
                job += "." + env.get("SLURM_STEP_ID", "0")
            local = env.get(local_var, "")
            one_host = local.isdigit() and int(local) == size  # Slurm's "2(x1)" on several hosts is not
            return LaunchEnv(source, int(env[rank_var]), size, host, int(env.get("MASTER_PORT", 0)), job, one_host)
    return None


def job_directory(launch: LaunchEnv, temp: str, uid: int) -> str:
    """The private socket directory the ranks of one job on one host share: named from the job
    id and the user (characters a path cannot hold dropped)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in launch.job)
    return f"{temp.rstrip('/')}/meta-tp-job-{uid}-{safe}"


def first_slurm_host(nodelist: str) -> str:
    """'node[03-05,07],gpu1' -> 'node03' (the first host of a Slurm node list)."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" in head:
        prefix, rest = head.split("[", 1)
        return prefix + rest.split(",")[0].split("-")[0].rstrip("]")
    return head


def blas_threads(workers: int) -> int:
    """BLAS threads per CPU worker so that workers together use the cores once."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def worker_cpus(workers: int, threads: int, allowed: Sequence[int]) -> list[tuple[int, ...]] | None:
    """Disjoint CPUs for each of `workers` CPU workers of `threads` BLAS threads, from the CPUs
    this process may use, or None where they do not go round once (then the scheduler places
    them). A worker kept on its own cores never lands on its peer's core: two workers sharing
    one core trade it at every collective, and beside a busy process the scheduler does that
    often (one measured 4 KiB all-reduce: about 200 us unbound against 45 us bound)."""
    cpus = sorted(allowed)
    if workers < 1 or threads < 1 or workers * threads > len(cpus):
        return None
    return [tuple(cpus[w * threads : (w + 1) * threads]) for w in range(workers)]

"""The worker process (`python -m workers`): one per device.

`main` (sockets, watchdog, serve loop), `server` (one handler per message type, shared with the
simulator), `backends/` (what computes: one file per backend), `store` (resident tensors and a
memory budget), `executor` (runs programs), `collectives` and `nccl` (engines that run the
collective algorithms of split_state.algorithms on each data plane), `comm` (point-to-point
transport between workers), `generation` (the worker-driven decode loop), `simulator` (N workers
in one process, same code, no sockets).
"""

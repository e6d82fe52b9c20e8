"""The worker process (`python -m workers`): one per device.

`main` (sockets, watchdog, serve loop), `server` (one handler per message type, shared with the
simulator), `backends/` (what computes: one file per backend), `kernels/` (what each step runs),
`store` (resident tensors and a memory budget), `arena` (the programs' shared intermediates),
`binding` (the worker bound to its cores), `layouts` (which of a program's views copy),
`program` (a loaded program),
`straight` (a program written out as one function), `graphs` (device graphs: capture and
replay), `executor` (runs programs), `collectives` (the engine that runs the collective
algorithms of split_state.algorithms over a point-to-point comm), `comm` (point-to-point
transport between workers), `planes/` (the data planes; those with their own transport hold
their comm and engine), `generation` (the worker-driven decode loop), `simulator` (N workers in
one process, same code, no sockets).
"""

"""python -m workers --connect ENDPOINT --rank R ...: one worker process.
python -m workers --backends: this host's backends as JSON (what a coordinator asks before it
starts workers here; see meta/backends.py)."""

import sys

from workers.binding import bind_from_env, quiet_pools

if sys.argv[1:] == ["--backends"]:
    import json

    from workers.backends import describe

    print(json.dumps(describe()))
    sys.exit(0)

quiet_pools()  # before NumPy loads BLAS (the --backends answer above runs no products)
bind_from_env()  # before anything starts a thread

import faulthandler  # noqa: E402

# a crash in native code (NumPy, BLAS, numba, ZeroMQ) prints every thread's Python stack to
# stderr (the worker's log) instead of ending the process without a word
faulthandler.enable()

from workers.main import leave, main  # noqa: E402

leave(main())  # main(): every socket closed, every file of its own removed

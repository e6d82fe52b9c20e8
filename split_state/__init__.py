"""Split states and their math: pure values, no I/O, NumPy only.

States (`Split`, `Mirrored`, `Partial`) and `validate`; `pieces`, the one answer to "which slice
does device d hold"; host scatter/gather; the op table (`ops`: shape inference, propagation
rules, localisation; the kernels that run the ops live in workers/kernels); transitions and
their transfer plans; the collective algorithms (`algorithms`) that both the planner and the
workers consult; the quantized block formats (`quant`); the sampling rule (`sampling`) by which
the coordinator and the workers choose the same next token; the dtype set and the exception
hierarchy every other package uses.
"""

from split_state.algorithms import ALGORITHMS, Algorithm, Transition, select, transition
from split_state.dtypes import DTYPES, dtype_from_name, dtype_name
from split_state.errors import (
    ConsistencyError,
    DeadlineExceeded,
    FreedTensor,
    MetaError,
    OutOfMemory,
    ProtocolError,
    RemoteError,
    ShapeError,
    SplitError,
    TransportError,
    UnsupportedDtype,
    WorkerLost,
    WorkerTimeout,
)
from split_state.layout import Piece, local_shape, pieces
from split_state.ops import OPS
from split_state.rules import Signature, choose
from split_state.scatter import gather, reduce_sum, scatter
from split_state.states import MIRRORED, PARTIAL, Mirrored, Partial, Split, State, validate
from split_state.transitions import Collective, apply_reference

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "DTYPES",
    "MIRRORED",
    "OPS",
    "PARTIAL",
    "Collective",
    "ConsistencyError",
    "DeadlineExceeded",
    "FreedTensor",
    "MetaError",
    "Mirrored",
    "OutOfMemory",
    "Partial",
    "Piece",
    "ProtocolError",
    "RemoteError",
    "ShapeError",
    "Signature",
    "Split",
    "SplitError",
    "State",
    "Transition",
    "TransportError",
    "UnsupportedDtype",
    "WorkerLost",
    "WorkerTimeout",
    "apply_reference",
    "choose",
    "dtype_from_name",
    "dtype_name",
    "gather",
    "local_shape",
    "pieces",
    "reduce_sum",
    "scatter",
    "select",
    "transition",
    "validate",
]

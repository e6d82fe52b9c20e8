"""Split states and their math: pure values, no I/O, NumPy only."""

from split_state.dtypes import DTYPES, dtype_from_name, dtype_name
from split_state.errors import (
    ConsistencyError,
    DeadlineExceeded,
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
from split_state.transitions import Collective, Transition, apply_reference, transition

__all__ = [
    "DTYPES",
    "MIRRORED",
    "OPS",
    "PARTIAL",
    "Collective",
    "ConsistencyError",
    "DeadlineExceeded",
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
    "transition",
    "validate",
]

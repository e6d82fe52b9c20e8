"""Placing tensors on the workers and reading them back: the placement half of MetaDevice
(meta/device.py), a mixin over the device's state (its ids, feeds, released tensors, policy and
`_call`). A host array is sliced per device and sent (a large one a device at a time), a small
input fed with the next run, a placeholder stands for a tensor a prepared step will be given;
`get` gathers a value back, `free` and `collect` release storage."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meta.graph import Node
from meta.serialized import serialized
from meta.tensor import Tensor
from split_state import errors
from split_state.dtypes import dtype_name
from split_state.errors import MetaError
from split_state.layout import Piece, local_shape, pieces
from split_state.scatter import extract, gather
from split_state.states import MIRRORED, State, validate
from transport import protocol as p

Policy = Callable[[str, tuple[int, ...]], State | None]
PLACE_BYTES = 16 << 20  # slices of one tensor held for one Put message at most (more: sent device by device)


class Placement:
    """MetaDevice's placement and reading methods."""

    @serialized
    def tensor(self, array: Any, state: State | None = None, name: str = "") -> Tensor:
        """A resident tensor from a host array: each worker receives only its slice."""
        array = np.asarray(array)
        dtype = dtype_name(array.dtype)
        state = self._placement(name, array.shape, state)
        return self._place(
            name,
            array.shape,
            dtype,
            state,
            lambda d: extract(array, state, self.n, d),
        )

    @serialized
    def from_generator(
        self,
        shape: Sequence[int],
        dtype: Any,
        state: State | None,
        make: Callable[[int, tuple[Piece, ...]], np.ndarray],
        name: str = "",
    ) -> Tensor:
        """A resident tensor built per device: `make(device, pieces)` returns that device's local
        array, so a large weight never exists whole on the host."""
        shape = tuple(int(s) for s in shape)
        state = self._placement(name, shape, state)
        return self._place(
            name, shape, dtype_name(dtype), state, lambda d: np.asarray(make(d, pieces(state, shape, self.n, d)))
        )

    @serialized
    def feed(self, array: Any, name: str = "") -> Tensor:
        """A small Mirrored input (token ids, positions) that travels inside the next run's message
        instead of a placement round trip of its own; its value is known here, so reading it
        costs nothing."""
        array = np.array(array, copy=True)
        dtype = dtype_name(array.dtype)
        tensor = next(self._tensor_ids)
        self._feeds[tensor] = array
        node = self._resident(Node("", (), {}, tuple(array.shape), dtype, name), tensor, MIRRORED)
        return Tensor(self, node)

    def placeholder(self, shape: Sequence[int], dtype: Any, state: State, name: str = "") -> Tensor:
        """A stand-in for prepare(): a tensor of this shape, dtype and state that holds nothing
        on the workers. A step prepared over it is called with a real one in its place (the
        output of another step, say); a run that reads the placeholder itself fails on the
        workers (the tensor is not stored)."""
        shape = tuple(int(s) for s in shape)
        validate(state, shape, self.n, name=name or "placeholder")
        node = Node("", (), {}, shape, dtype_name(np.dtype(dtype)), name or "placeholder")
        node.tensor, node.state = next(self._tensor_ids), state  # nothing stored: nothing to release
        return Tensor(self, node)

    def _placement(self, name: str, shape: tuple[int, ...], state: State | None) -> State:
        if state is None and self.policy is not None:
            state = self.policy(name, tuple(shape))
        state = MIRRORED if state is None else state
        validate(state, shape, self.n, name=name or "tensor")
        return state

    def _place(self, name, shape, dtype, state, local) -> Tensor:
        tensor = next(self._tensor_ids)
        messages = {}
        try:
            for d in range(self.n):
                array = local(d)
                expected = local_shape(state, shape, self.n, d)
                if tuple(array.shape) != expected or dtype_name(array.dtype) != dtype:
                    raise errors.SplitError(
                        f"{name or 'tensor'}: device {d} local array is {array.shape} {array.dtype}, "
                        f"{state} of {shape} needs {expected} {dtype}"
                    )
                messages[d] = p.Put(tensor, state, tuple(shape), array)
                if sum(m.array.nbytes for m in messages.values()) >= PLACE_BYTES:
                    # a large weight goes a device at a time: its slices never all exist on this
                    # host at once (one slice, not a whole copy, beside the source)
                    self._call(messages)
                    messages = {}
            if messages:
                self._call(messages)
        except MetaError:
            with contextlib.suppress(MetaError):  # a lost cluster cannot free; the first error is the news
                self._free_ids([tensor])  # nothing half-placed stays behind
            raise
        return Tensor(self, self._resident(Node("", (), {}, tuple(shape), dtype, name), tensor, state))

    def _resident(self, node: Node, tensor: int, state: State) -> Node:
        """Mark `node` resident; when nothing references it any more its storage is released on
        the workers with the next run (no message of its own)."""
        node.tensor, node.state = tensor, state
        node.finalizer = weakref.finalize(node, self.ledger.release_one, tensor)
        return node

    @serialized
    def get(self, t: Tensor) -> np.ndarray:
        """The global value as a host array, whatever the state (Partial is summed)."""
        self.run(t)
        node = t.node
        if node.tensor in self._feeds:
            return self._feeds[node.tensor].copy()
        if node.host is not None:  # read back with the run that made it
            return node.host.copy()
        if self._one_copy(node.state):
            reader = self._reader(node.state)
            return np.array(self._call({reader: p.Get(node.tensor)})[reader].array, copy=True)
        replies = self._call({d: p.Get(node.tensor) for d in range(self.n)})
        locals_ = [np.asarray(replies[d].array) for d in range(self.n)]
        return gather(locals_, node.state, check_mirrored=self.check_mirrored)

    @serialized
    def free(self, *tensors: Tensor) -> None:
        ids = [t.node.tensor for t in tensors if t.node.resident]
        for t in tensors:
            if t.node.finalizer is not None:
                t.node.finalizer.detach()
            t.node.tensor, t.node.state, t.node.finalizer = None, None, None
        self._free_ids(ids)

    @serialized
    def collect(self) -> None:
        """Release now the storage of tensors whose handles are gone (runs do it anyway)."""
        released = self.ledger.take()
        self._free_ids(released)

    def _free_ids(self, ids: list[int]) -> None:
        for tensor in ids:
            self._feeds.pop(tensor, None)
        if ids:
            self._call({d: p.Free(ids) for d in range(self.n)})

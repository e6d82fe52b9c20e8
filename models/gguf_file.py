"""A GGUF file's metadata and tensor table, read in a fraction of the time `gguf.GGUFReader` takes.

gguf's reader builds a NumPy memmap view for every part of every metadata field: for a model with
a 49,152-token vocabulary and as many merges that is a million views and 2.4 s (SmolLM2-135M on
2 cores), before any check can run. This reads the same file format (GGUF v2 and v3, little-endian)
with `struct` over one memory map, about a tenth of the time, and checks what gguf's reader does
not: every tensor's data lies inside the file (a truncated download is an error naming the tensor,
not a short array). Tensor data are read-only NumPy views of the map, laid out as gguf's reader
lays them out (float types as typed arrays in NumPy order, quantized types as their raw block
bytes, (rows, row bytes)), so `gguf.quants.dequantize` takes them as they are. The tests compare
every field and tensor with gguf's own reader.

The format (ggml's docs/gguf.md): magic "GGUF", version, tensor count, field count; the fields
(key, value type, value); the tensor infos (name, dimensions innermost first, type, offset); the
data, aligned to `general.alignment` (32 by default).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: GGUF files nest one level; a deeper one is an attack, not a model
MAX_ALIGNMENT = 1 << 20
# what a model's header holds at most, far above any real file (a 405B Llama lists 1,138 tensors; a
# 262,144-token vocabulary with its scores and types is 786,432 array items): a header past them is
# refused before it is read, where reading it would cost seconds and gigabytes (a million zero-size
# tensor infos, a 50 MB array: each item a Python object of 8 to 50 bytes)
MAX_TENSORS = 1 << 16
MAX_FIELDS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22  # in all the header's arrays together

# value types (gguf.GGUFValueType): the struct code of each fixed-size one
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_TYPED = {  # ggml types gguf's reader shows as typed arrays; every other type is raw block bytes
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can read (what is wrong, and where)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: innermost dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the file
    begin: int = 0  # where its bytes lie in the file
    nbytes: int = 0


class GGUFFile:
    """`fields`: key -> value (int, float, bool, str, or a list of them); `tensors`: name -> TensorInfo."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFormatError("the file is empty") from None
        self._buf = memoryview(self._map)
        self._at = 0
        if self._take(4) != MAGIC:
            raise GGUFFormatError("no GGUF magic at its start")
        version = self._scalar("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (this reader reads versions 2 and 3, little-endian)")
        tensor_count, field_count = self._scalar("Q"), self._scalar("Q")
        if tensor_count > MAX_TENSORS or field_count > MAX_FIELDS:
            raise GGUFFormatError(
                f"the header lists {tensor_count} tensors and {field_count} fields; this reader takes at most "
                f"{MAX_TENSORS} of each (a model has hundreds)"
            )
        self._items_left = MAX_ARRAY_ITEMS
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"), key)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            n_dims = self._scalar("I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {_short(name)}: {n_dims} dimensions")
            shape = tuple(self._scalar("Q") for _ in range(n_dims))
            kind, offset = self._scalar("I"), self._scalar("Q")
            infos.append((name, shape, kind, offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise GGUFFormatError(
                f"general.alignment {_short(repr(alignment))} is not a power of two up to {MAX_ALIGNMENT}"
            )
        start = -(-self._at // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        spans = []  # (begin, end, name) of every tensor's bytes: none may overlap another's
        for name, shape, kind, offset in infos:
            if name in self.tensors:
                raise GGUFFormatError(f"tensor {_short(name)} appears twice")
            try:
                ggml_type = GGMLQuantizationType(kind)
                block, block_bytes = GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"tensor {_short(name)}: unknown type {kind}") from None
            if shape[0] % block:
                raise GGUFFormatError(f"tensor {_short(name)}: {shape[0]} values per row, not whole blocks of {block}")
            if offset % alignment:
                raise GGUFFormatError(
                    f"tensor {_short(name)}: offset {offset} is not a multiple of the alignment {alignment}"
                )
            count = math.prod(shape)  # Python's integers: dimensions of 2**32 x 2**32 do not wrap
            nbytes = count // block * block_bytes
            begin = start + offset
            if begin + nbytes > len(self._map):
                raise GGUFFormatError(
                    f"tensor {_short(name)} needs bytes {begin}..{begin + nbytes} but the file ends at "
                    f"{len(self._map)} (truncated?)"
                )
            spans.append((begin, begin + nbytes, name))
            dims = tuple(reversed(shape))  # NumPy order
            typed = _TYPED.get(ggml_type.name)
            if typed is not None:
                data = np.frombuffer(self._map, typed, count, begin).reshape(dims)
            else:
                data = np.frombuffer(self._map, np.uint8, nbytes, begin).reshape(*dims[:-1], -1)
            self.tensors[name] = TensorInfo(name, shape, ggml_type, data, begin, nbytes)
        _refuse_overlaps(spans)

    def release(self, t: TensorInfo | None = None) -> None:
        """Hand back the resident pages of tensor `t`'s bytes (all the file's, without one): the
        mapping stays valid, and a page read again comes back from the file. A coordinator
        that has sent a weight to its workers no longer needs it in memory: without this its
        resident set grew to the model's size (1.15 GB for a 1.7B Q4_1 file)."""
        page = mmap.PAGESIZE
        begin, end = (0, len(self._map)) if t is None else (t.begin, t.begin + t.nbytes)
        start = begin // page * page
        if end > start and hasattr(self._map, "madvise"):
            try:
                self._map.madvise(mmap.MADV_DONTNEED, start, min(len(self._map), -(-end // page) * page) - start)
            except (OSError, ValueError):  # a platform without it: the pages stay, nothing is lost
                pass

    # -- the parts of the header ----------------------------------------------------------------

    def _take(self, n: int) -> bytes:
        if self._at + n > len(self._buf):
            raise GGUFFormatError(f"the header ends early, at byte {len(self._buf)}")
        out = bytes(self._buf[self._at : self._at + n])
        self._at += n
        return out

    def _scalar(self, code: str):
        try:
            (value,) = struct.unpack_from("<" + code, self._buf, self._at)
        except struct.error:
            raise GGUFFormatError(f"the header ends early, at byte {len(self._buf)}") from None
        self._at += struct.calcsize(code)
        return value

    def _string(self) -> str:
        size = self._scalar("Q")
        if size > len(self._buf) - self._at:
            raise GGUFFormatError(f"a string of {size} bytes at byte {self._at} runs past the file's end")
        raw = self._take(size)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"a string at byte {self._at - len(raw)} is not UTF-8") from None

    def _value(self, kind: int, key: str, depth: int = 0) -> Any:
        code = _SCALARS.get(kind)
        if code is not None:
            return self._scalar(code)
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"field {_short(key)}: unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise GGUFFormatError(f"field {_short(key)}: arrays nested deeper than {MAX_NESTING}")
        item, count = self._scalar("I"), self._scalar("Q")
        # every element takes at least a byte (a string or an array: 8 or 12): a count the rest of
        # the file cannot hold is refused before any loop runs over it
        if count > len(self._buf) - self._at:
            raise GGUFFormatError(f"field {_short(key)}: {count} elements, more than the file's bytes")
        self._items_left -= count
        if self._items_left < 0:
            raise GGUFFormatError(
                f"field {_short(key)}: {count} elements take the header's arrays past {MAX_ARRAY_ITEMS} items "
                "in all (a model's vocabulary and its scores hold some hundred thousand)"
            )
        code = _SCALARS.get(item)
        if code is not None:  # numbers: one unpack for the whole array
            size = struct.calcsize(code) * count
            if self._at + size > len(self._buf):
                raise GGUFFormatError(f"field {_short(key)}: the header ends early, at byte {len(self._buf)}")
            values = list(struct.unpack_from(f"<{count}{code}", self._buf, self._at))
            self._at += size
            return values
        if item == _STRING:
            return [self._string() for _ in range(count)]
        return [self._value(item, key, depth + 1) for _ in range(count)]


def _short(text: str, most: int = 80) -> str:
    """A name read from the file, for a one-line message: control characters escaped (a name
    may hold a newline), at most `most` characters of it."""
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= most else text[:most] + f"... ({len(text)} characters)"


shown_name = _short  # for the messages of the modules that read a GGUFFile


def _refuse_overlaps(spans: list[tuple[int, int, str]]) -> None:
    """Two tensors whose bytes overlap (aliased at one offset, say) are a malformed file: a
    weight would be read as another's."""
    last_end, last_name = -1, ""
    for begin, end, name in sorted(spans):
        if begin < last_end and end > begin:
            both = f"{_short(last_name)} and {_short(name)}"
            raise GGUFFormatError(f"tensors {both} overlap in the file (bytes from {begin})")
        if end > last_end:
            last_end, last_name = end, name

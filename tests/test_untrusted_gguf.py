"""A GGUF file is untrusted input: every malformed header and every field of the wrong type or
size ends in a one-line ModelError (GGUFFormatError for the bytes), in bounded time and memory,
before anything is built from it. The files are written byte by byte here (gguf's writer would
refuse most of them), and hypothesis mutates a valid file's header and fields."""

from __future__ import annotations

import math
import struct
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.gguf_file import GGUFFile
from models.gguf_model import GGUFModel, ModelError

pytestmark = pytest.mark.timeout(300)

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
TIME_LIMIT, MEMORY_LIMIT = 5.0, 500 << 20


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def value(kind: int, v) -> bytes:
    """A field's value bytes (after its type)."""
    codes = {
        U8: "B",
        I8: "b",
        U16: "H",
        I16: "h",
        U32: "I",
        I32: "i",
        F32: "f",
        BOOL: "?",
        U64: "Q",
        I64: "q",
        F64: "d",
    }
    if kind == STRING:
        return string(v)
    if kind == ARRAY:
        item, items = v
        return struct.pack("<IQ", item, len(items)) + b"".join(value(item, x) for x in items)
    return struct.pack("<" + codes[kind], v)


def field(key: str, kind: int, v) -> bytes:
    return string(key) + struct.pack("<I", kind) + value(kind, v)


def raw_gguf(fields: list[bytes], tensors: list[tuple[str, tuple, int, int]] = (), data: bytes = b"", align=32):
    """A GGUF v3 file: fields (already encoded), tensor infos (name, ggml dims, type, offset)
    and the data after the header, padded to `align`."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields)) + b"".join(fields)
    for name, dims, kind, offset in tensors:
        head += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", kind, offset)
    return head + bytes(-len(head) % align) + data


LLAMA = [field("general.architecture", STRING, "llama")]
VOCAB = field("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b", "ab", "abc", "c"]))


def sizes(**over) -> list[bytes]:
    base = {"embedding_length": 8, "block_count": 1, "attention.head_count": 2, "feed_forward_length": 12}
    base |= over
    out = []
    for key, v in base.items():
        if isinstance(v, bytes):
            out.append(v)
        elif isinstance(v, str):
            out.append(field(f"llama.{key}", STRING, v))
        elif isinstance(v, float):
            out.append(field(f"llama.{key}", F32, v))
        else:
            out.append(field(f"llama.{key}", U64 if v >= 2**32 else U32, v))
    return out


def load(path):
    """What the CLI does with a file before any worker starts (and the tokenizer, if any)."""
    model = GGUFModel(path)
    model.check()
    _ = model.eos, model.end_of_generation, model.chat_template
    if "tokenizer.ggml.model" in model.file.fields:
        _ = model.tokenizer
    return model


def refused_in_one_line(path, says: str = "", read=load) -> str:
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(ModelError) as caught:
            read(path)
    finally:
        seconds = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    text = str(caught.value)
    assert "\n" not in text and says in text, text
    assert seconds < TIME_LIMIT and peak < MEMORY_LIMIT, (seconds, peak)
    return text


F32_TYPE, Q4_0_TYPE = 0, 2
HEADER_CASES = {
    "dimensions whose product wraps in int64": ([], [("w", (2**32, 2**32), F32_TYPE, 0)], "needs bytes"),
    "(2^62 + 1) x 2": ([], [("w", (2**62 + 1, 2), F32_TYPE, 0)], "needs bytes"),
    "2^64 - 1 values": ([], [("w", (2**64 - 1,), F32_TYPE, 0)], "needs bytes"),
    "a zero-dimensional tensor": ([], [("w", (), F32_TYPE, 0)], "0 dimensions"),
    "five dimensions": ([], [("w", (1, 1, 1, 1, 1), F32_TYPE, 0)], "5 dimensions"),
    "an unknown tensor type": ([], [("w", (4,), 999, 0)], "unknown type 999"),
    "rows not of whole blocks": ([], [("w", (33, 1), Q4_0_TYPE, 0)], "not whole blocks"),
    "a misaligned offset": ([], [("w", (4,), F32_TYPE, 4)], "not a multiple of the alignment"),
    "two tensors at one offset": ([], [("a", (8,), F32_TYPE, 0), ("b", (8,), F32_TYPE, 0)], "overlap"),
    "a duplicate tensor name": ([], [("a", (8,), F32_TYPE, 0), ("a", (8,), F32_TYPE, 32)], "appears twice"),
    "an alignment that is a string": ([field("general.alignment", STRING, "32")], [], "general.alignment"),
    "an alignment that is NaN": ([field("general.alignment", F32, math.nan)], [], "general.alignment"),
    "an alignment that is inf": ([field("general.alignment", F64, math.inf)], [], "general.alignment"),
    "an alignment that is a list": ([field("general.alignment", ARRAY, (U32, [32]))], [], "general.alignment"),
    "an alignment of 3": ([field("general.alignment", U32, 3)], [], "general.alignment"),
    "an alignment of 0": ([field("general.alignment", U32, 0)], [], "general.alignment"),
    "an alignment of 2^40": ([field("general.alignment", U64, 2**40)], [], "general.alignment"),
    "an unknown value type": ([string("k") + struct.pack("<I", 77)], [], "unknown value type 77"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_a_malformed_header_is_refused_in_one_line(tmp_path, case):
    fields, tensors, says = HEADER_CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw_gguf(LLAMA + fields, tensors, bytes(64)))
    refused_in_one_line(path, says)


def nested(depth: int) -> bytes:
    inner = struct.pack("<IQ", U8, 0)
    for _ in range(depth):
        inner = struct.pack("<IQ", ARRAY, 1) + inner
    return string("deep") + struct.pack("<I", ARRAY) + inner


RAW_CASES = {
    "a 5,000-deep nested array": (nested(5000), "nested deeper"),
    "an array of 2^62 bytes": (string("k") + struct.pack("<IIQ", ARRAY, U8, 2**62), "more than the file's bytes"),
    "an array of 2^62 strings": (string("k") + struct.pack("<IIQ", ARRAY, STRING, 2**62), "more than the file's"),
    "a string of 2^63 bytes": (string("k") + struct.pack("<IQ", STRING, 2**63), "runs past the file's end"),
    "a key of 2^63 bytes": (struct.pack("<Q", 2**63), "runs past the file's end"),
    "a key that is not UTF-8": (string(b"\xff\xfe") + struct.pack("<I", U8) + b"\x01", "not UTF-8"),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_a_field_that_cannot_be_read_is_refused_in_one_line(tmp_path, case):
    raw, says = RAW_CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw_gguf(LLAMA + [raw]))
    refused_in_one_line(path, says)


def test_dimensions_past_the_end_of_the_file_are_refused(tmp_path):
    whole = raw_gguf(LLAMA, [("w", (4, 4, 4, 4), F32_TYPE, 0)])
    cut = whole.index(struct.pack("<I", 4) + struct.pack("<Q", 4)) + 12  # inside the dimensions
    (tmp_path / "bad.gguf").write_bytes(whole[:cut])
    refused_in_one_line(tmp_path / "bad.gguf", "ends early")


META_CASES = {
    "embedding_length that is text": (sizes(embedding_length="abc") + [VOCAB], "'llama.embedding_length' must be"),
    "block_count of 10^9": (sizes(block_count=10**9) + [VOCAB], "'llama.block_count' must be an integer in"),
    "block_count with no blocks": (sizes(block_count=3) + [VOCAB], "block_count is 3 but the file holds no blocks"),
    "a NaN rope base": (sizes(**{"rope.freq_base": math.nan}) + [VOCAB], "'llama.rope.freq_base' must be"),
    "a NaN epsilon": (
        sizes(**{"attention.layer_norm_rms_epsilon": math.nan}) + [VOCAB],
        "layer_norm_rms_epsilon' must be a positive",
    ),
    "a negative epsilon": (
        sizes(**{"attention.layer_norm_rms_epsilon": -1.0}) + [VOCAB],
        "layer_norm_rms_epsilon' must be a positive",
    ),
    "tokens that are a number": (sizes() + [field("tokenizer.ggml.tokens", U32, 5)], "must be a list of str"),
    "tokens that are numbers": (
        sizes() + [field("tokenizer.ggml.tokens", ARRAY, (U32, [1, 2, 3]))],
        "must be a list of str",
    ),
    "a one-token vocabulary": (sizes() + [field("tokenizer.ggml.tokens", ARRAY, (STRING, ["a"]))], "a vocabulary of 1"),
    "values of another size than keys": (
        sizes(**{"attention.key_length": 4, "attention.value_length": 8}) + [VOCAB],
        "value_length 8 differs from the key length 4",
    ),
    "heads of an odd size": (sizes(**{"attention.key_length": 3}) + [VOCAB], "head size 3 is odd"),
}
# fields read past check(), by what reads them (the file has no tensors to pass check() with)
READ_CASES = {
    "an eos id that is text": (field("tokenizer.ggml.eos_token_id", STRING, "x"), "eos_token_id", "eos"),
    "an eos id past the vocabulary": (field("tokenizer.ggml.eos_token_id", U32, 99), "in [0, 4]", "eos"),
    "a bos id past the vocabulary": (field("tokenizer.ggml.bos_token_id", I32, -5), "bos_token_id", "tokenizer"),
    "a short token_type list": (
        field("tokenizer.ggml.token_type", ARRAY, (I32, [1, 1])),
        "2 token types for a vocabulary of 5",
        "end_of_generation",
    ),
    "merges that are integers": (field("tokenizer.ggml.merges", ARRAY, (U32, [1])), "merges' must be", "tokenizer"),
    "a merge of one token": (field("tokenizer.ggml.merges", ARRAY, (STRING, ["ab"])), "not two tokens", "tokenizer"),
    "a merge whose join is missing": (
        field("tokenizer.ggml.merges", ARRAY, (STRING, ["b c"])),
        "whose join is one too",
        "tokenizer",
    ),
    "a merge of unknown tokens": (field("tokenizer.ggml.merges", ARRAY, (STRING, ["x y"])), "merges", "tokenizer"),
    "add_bos that is text": (field("tokenizer.ggml.add_bos_token", STRING, "yes"), "add_bos_token", "tokenizer"),
    "a chat template that is a number": (field("tokenizer.chat_template", U32, 7), "chat_template", "chat_template"),
}


@pytest.mark.parametrize("case", list(READ_CASES))
def test_a_tokenizer_field_of_the_wrong_type_or_size_is_refused_where_it_is_read(tmp_path, case):
    raw, says, attribute = READ_CASES[case]
    path = tmp_path / "bad.gguf"
    gpt2 = field("tokenizer.ggml.model", STRING, "gpt2")
    merges = [] if b"merges" in raw else [field("tokenizer.ggml.merges", ARRAY, (STRING, ["a b", "ab c"]))]
    path.write_bytes(raw_gguf(LLAMA + sizes() + [VOCAB, gpt2, raw, *merges]))
    refused_in_one_line(path, says, lambda p: getattr(GGUFModel(p), attribute))


@pytest.mark.parametrize("case", list(META_CASES))
def test_metadata_of_the_wrong_type_or_size_is_refused_in_one_line(tmp_path, case):
    fields, says = META_CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw_gguf(LLAMA + fields))
    refused_in_one_line(path, says)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A small valid file (1 layer, 4 tokens, float32), its bytes and where its header ends."""
    from tests.gguf_files import tiny_llama

    path = tiny_llama(tmp_path_factory.mktemp("valid") / "v.gguf")
    load(path)  # the file the mutations start from is accepted
    raw = path.read_bytes()
    return raw, len(raw) - sum(t.data.nbytes for t in GGUFFile(path).tensors.values())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_header_loads_or_is_refused_in_one_line(valid, tmp_path, data):
    """hypothesis flips, overwrites and cuts the header's bytes (its counts, lengths, types,
    dimensions and offsets): whatever comes out loads, or is a one-line ModelError, within
    the time and memory bounds; never another exception."""
    raw, header = valid
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, header - 1))
        width = data.draw(st.sampled_from([1, 2, 4, 8]))
        fill = data.draw(st.binary(min_size=width, max_size=width))
        mutated[at : at + width] = fill
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(mutated))
    tracemalloc.start()
    start = time.monotonic()
    try:
        load(path)
    except ModelError as exc:
        assert "\n" not in str(exc), str(exc)
    finally:
        seconds, peak = time.monotonic() - start, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert seconds < TIME_LIMIT and peak < MEMORY_LIMIT, (seconds, peak)


def test_names_holding_a_newline_are_escaped_in_the_one_line_error(valid, tmp_path):
    """Found by 10,000 draws of the mutation test: a field's or a tensor's name is the file's
    text, and one holding a newline broke the one-line error. A field named "\\nlama..." of an
    unknown value type, and a tensor named "out\\nut_norm.weight" (which no decoder reads)."""
    raw, _ = valid
    at = raw.index(b"llama.attention.head_count\x04")
    field = bytearray(raw)
    field[at] = ord("\n")
    field[at + len(b"llama.attention.head_count") : at + len(b"llama.attention.head_count") + 4] = struct.pack(
        "<I", 260
    )
    (tmp_path / "field.gguf").write_bytes(bytes(field))
    refused_in_one_line(tmp_path / "field.gguf", "field \\nlama.attention.head_count: unknown value type 260")
    tensor = bytearray(raw)
    at = raw.index(b"output_norm.weight")
    tensor[at + 3] = ord("\n")
    (tmp_path / "tensor.gguf").write_bytes(bytes(tensor))
    refused_in_one_line(tmp_path / "tensor.gguf", "out\\nut_norm.weight")


@pytest.mark.parametrize(
    "counts, says",
    [((10**6, 0), "1000000 tensors"), ((0, 10**6), "1000000 fields"), ((2**64 - 1, 0), "at most 65536")],
)
def test_a_header_listing_more_tensors_or_fields_than_any_model_is_refused_before_it_is_read(tmp_path, counts, says):
    """A million zero-size tensor infos cost 12.5 s and 1.2 GB before their one-line error."""
    path = tmp_path / "many.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, *counts) + bytes(64))
    refused_in_one_line(path, says)


def test_metadata_arrays_past_the_headers_bound_are_refused_before_they_are_read(tmp_path):
    """Each array item becomes a Python object of 8-50 bytes: 5 million one-byte items (a 5 MB
    field) are refused by count, in all the header's arrays together."""
    many = string("x.many") + struct.pack("<IIQ", ARRAY, U8, 5_000_000) + bytes(5_000_000)
    (tmp_path / "one.gguf").write_bytes(raw_gguf(LLAMA + [many]))
    refused_in_one_line(tmp_path / "one.gguf", "past 4194304 items")
    half = string("x.half") + struct.pack("<IIQ", ARRAY, U8, 2_500_000) + bytes(2_500_000)
    other = string("x.other") + struct.pack("<IIQ", ARRAY, U8, 2_500_000) + bytes(2_500_000)
    (tmp_path / "two.gguf").write_bytes(raw_gguf(LLAMA + [half, other]))
    refused_in_one_line(tmp_path / "two.gguf", "field x.other: 2500000 elements")


def test_a_block_number_that_is_a_digit_but_not_ascii_is_refused_in_one_line(tmp_path):
    """'²'.isdigit() is True and int('²') raises: the block count's message met it."""
    tensors = [("blk.\u00b2.attn_norm.weight", (8,), F32_TYPE, 0)]
    (tmp_path / "sup.gguf").write_bytes(raw_gguf(LLAMA + sizes() + [VOCAB], tensors, bytes(32)))
    refused_in_one_line(tmp_path / "sup.gguf", "block_count is 1 but the file holds no blocks")


def test_a_zero_where_a_positive_number_is_needed_is_refused(tmp_path):
    """meta_float takes positive finite numbers: 0 as rope base (every frequency infinite) too."""
    (tmp_path / "zero.gguf").write_bytes(raw_gguf(LLAMA + sizes(**{"rope.freq_base": 0.0}) + [VOCAB]))
    refused_in_one_line(tmp_path / "zero.gguf", "'llama.rope.freq_base' must be a positive")


def nested(levels: int) -> bytes:
    """A field holding `levels` arrays, each the one element of the one around it, of one U32."""
    inner: tuple = (U32, [7])
    for _ in range(levels - 1):
        inner = (ARRAY, [inner])
    return field("x.nested", ARRAY, inner)


def test_arrays_nested_to_the_bound_are_read_and_one_level_more_refused(tmp_path):
    from models.gguf_file import MAX_NESTING

    (tmp_path / "deep.gguf").write_bytes(raw_gguf(LLAMA + [nested(MAX_NESTING)]))
    value = GGUFFile(tmp_path / "deep.gguf").fields["x.nested"]
    for _ in range(MAX_NESTING - 1):
        (value,) = value
    assert value == [7]
    (tmp_path / "deeper.gguf").write_bytes(raw_gguf(LLAMA + [nested(MAX_NESTING + 1)]))
    refused_in_one_line(tmp_path / "deeper.gguf", f"nested deeper than {MAX_NESTING}")


def test_an_overlap_behind_an_empty_tensor_is_still_found(tmp_path):
    """a: bytes 0..64, e: empty at 32, b: 48..80. Sorted by start, the empty tensor comes between
    the two that overlap: it must not hide a's end."""
    tensors = [("a", (16,), F32_TYPE, 0), ("e", (0,), F32_TYPE, 32), ("b", (8,), F32_TYPE, 64)]
    ok = raw_gguf(LLAMA, tensors, bytes(96))
    assert set(GGUFFile_from(tmp_path, ok).tensors) == {"a", "e", "b"}  # apart: read
    tensors[2] = ("b", (8,), F32_TYPE, 32)
    (tmp_path / "hidden.gguf").write_bytes(raw_gguf(LLAMA, tensors, bytes(96)))
    refused_in_one_line(tmp_path / "hidden.gguf", "tensors a and b overlap")


def GGUFFile_from(folder, raw: bytes) -> GGUFFile:  # noqa: N802 - a constructor's name
    (folder / "file.gguf").write_bytes(raw)
    return GGUFFile(folder / "file.gguf")

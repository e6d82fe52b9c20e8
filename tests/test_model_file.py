"""Model files read fast and checked before any worker starts: our GGUF reader against gguf's own
on the packaged model and on a file of every value type; a model whose metadata and tensors
disagree (zero or indivisible heads, a tensor of the wrong shape, a truncated file) is a one-line
error naming what is wrong, from `launch.py generate` before it starts a worker."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.gguf_file import GGUFFile, GGUFFormatError
from models.gguf_model import GGUFModel, ModelError
from tests.gguf_files import tiny_llama

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def same_as_ggufs_reader(path: Path) -> None:
    import gguf

    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    names = {k for k in theirs.fields if not k.startswith("GGUF.")}  # the reader's own pseudo-fields
    assert set(ours.fields) == names
    for name in names:
        want = theirs.fields[name].contents()
        assert ours.fields[name] == want and type(ours.fields[name]) is type(want), name
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        got = ours.tensors[t.name]
        assert got.tensor_type == t.tensor_type and got.shape == tuple(t.shape.tolist()), t.name
        assert got.data.dtype == t.data.dtype and got.data.shape == t.data.shape, t.name
        assert np.array_equal(got.data, t.data), t.name


def test_the_packaged_model_reads_as_ggufs_reader_reads_it(model):
    same_as_ggufs_reader(model.path)


def test_every_value_type_and_tensor_layout_reads_as_ggufs_reader_reads_it(tmp_path):
    import gguf

    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü"])
    rng = np.random.default_rng(1)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    same_as_ggufs_reader(path)
    assert GGUFFile(path).tensors["q8"].data.shape == (2, 2 * 34)  # two blocks of 34 bytes per row


def test_a_consistent_tiny_model_passes_its_checks(tmp_path):
    model = GGUFModel(tiny_llama(tmp_path / "ok.gguf"))
    model.check()  # every refusal below is of one thing wrong, not of the tiny model itself
    assert (model.config.hidden, model.config.heads, model.config.kv_heads) == (8, 2, 1)


def test_native_weights_name_the_matrix_types_they_widen_to_float32(tmp_path):
    import gguf

    from cli.display import widening_notice

    model = GGUFModel(tiny_llama(tmp_path / "f16.gguf", dtypes={"blk.0.ffn_up.weight": np.float16}))
    assert model.widened() == ["F16"]
    bf16 = {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.BF16}
    assert GGUFModel(tiny_llama(tmp_path / "bf16.gguf", dtypes=bf16)).widened() == []  # kept as it is
    said = io.StringIO()
    widening_notice(model, "native", said)
    assert said.getvalue().startswith("note: F16 matrices become float32 on the workers")
    assert said.getvalue().count("\n") == 1
    said = io.StringIO()
    widening_notice(model, "f32", said)
    assert said.getvalue() == ""


CASES = {
    "zero heads": (dict(meta={"heads": 0}), "heads is 0 in the metadata"),
    "hidden not divisible by heads": (dict(meta={"heads": 3, "kv_heads": 1}), "8 is not divisible by the 3"),
    "heads not divisible by KV heads": (dict(meta={"heads": 4, "kv_heads": 3}), "4 attention heads are not divisible"),
    "an odd head size": (dict(meta={"heads": 8, "kv_heads": 1}), "head size 1 is odd; rope rotates pairs"),
    "rope over part of a head": (
        dict(extra={"llama.rope.dimension_count": 2}),
        "rope rotates 2 of each head's 4 values; only whole heads are",
    ),
    "YaRN rope scaling": (
        dict(extra={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
        "rope scaling 'yarn' by 4 is not supported (linear is)",
    ),
    "rope frequency factors of the wrong count": (
        dict(shapes={"rope_freqs.weight": (3,)}),
        "rope_freqs.weight must hold head_dim / 2 = 2 positive finite factors, got 3 values",
    ),
    "a tensor the decoder would not read": (
        dict(shapes={"blk.0.attn_output.bias": (8,)}),
        "tensor blk.0.attn_output.bias is not one this decoder reads",
    ),
    "a tensor of the wrong shape": (dict(shapes={"blk.0.attn_k.weight": (8, 6)}), "attn_k.weight has shape [8, 6]"),
    "a truncated file": (dict(truncate=100), "truncated"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_whose_metadata_and_tensors_disagree_is_refused(tmp_path, case):
    options, message = CASES[case]
    with pytest.raises(ModelError, match=re.escape(message)):
        GGUFModel(tiny_llama(tmp_path / "bad.gguf", **options)).check()


def test_generate_refuses_a_bad_model_in_one_line_before_any_worker_starts(tmp_path):
    path = tiny_llama(tmp_path / "bad.gguf", meta={"heads": 4, "kv_heads": 3})
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "generate", "hi", "-m", str(path), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "not divisible by the 3 KV heads" in out.stderr  # no worker's lines


def test_a_file_that_is_not_gguf_says_where_it_is_wrong(tmp_path):
    cases = [(b"", "empty"), (b"GGML" + bytes(20), "no GGUF magic"), (b"GGUF\x07\x00\x00\x00", "version 7")]
    for data, message in cases:
        (tmp_path / "x.gguf").write_bytes(data)
        with pytest.raises(GGUFFormatError, match=message):
            GGUFFile(tmp_path / "x.gguf")
    whole = tiny_llama(tmp_path / "t.gguf").read_bytes()
    (tmp_path / "x.gguf").write_bytes(whole[:200])  # cut inside the header
    with pytest.raises(GGUFFormatError, match="ends early"):
        GGUFFile(tmp_path / "x.gguf")

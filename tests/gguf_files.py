"""GGUF files made in tests: a copy of a model with some metadata replaced (as llama.cpp's
gguf-new-metadata does), written with gguf's own writer."""

from __future__ import annotations

from pathlib import Path


def copy_with_metadata(source: Path, target: Path, replace: dict[str, str | bool]) -> Path:
    """Copy GGUF `source` to `target`, fields in `replace` set to the given strings or booleans."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(target), arch, endianess=reader.endianess)
    pending = dict(replace)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = pending.pop(field.name, None)
        if value is not None:
            writer.add_key_value(field.name, value, _kind(value))
        else:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, value in pending.items():
        writer.add_key_value(key, value, _kind(value))
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return target


TINY = {"hidden": 8, "heads": 2, "kv_heads": 1, "ffn": 12, "layers": 1, "vocab": 16}


def tiny_llama(
    target: Path,
    meta: dict | None = None,
    shapes: dict | None = None,
    truncate: int = 0,
    dtypes: dict | None = None,
    extra: dict | None = None,
) -> Path:
    """A small llama-architecture GGUF file (random float32 weights, TINY's sizes): `meta`
    overrides sizes in the metadata, `shapes` a tensor's shape (ggml order; a new name adds a
    tensor), `truncate` cuts that many bytes off the end of the file, `dtypes` the NumPy dtype or
    ggml type a tensor is written in, `extra` more metadata (an int, float or string each)."""
    import gguf
    import numpy as np

    size = {**TINY, **(meta or {})}
    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_uint32("llama.embedding_length", size["hidden"])
    writer.add_uint32("llama.attention.head_count", size["heads"])
    writer.add_uint32("llama.attention.head_count_kv", size["kv_heads"])
    writer.add_uint32("llama.feed_forward_length", size["ffn"])
    writer.add_uint32("llama.block_count", size["layers"])
    writer.add_uint32("llama.context_length", 64)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(TINY["vocab"])])
    for key, value in (extra or {}).items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}[type(value)]
        add(key, value)
    h, kv, f, v = TINY["hidden"], TINY["hidden"] // TINY["heads"] * TINY["kv_heads"], TINY["ffn"], TINY["vocab"]
    tensors = {"token_embd.weight": (h, v), "output_norm.weight": (h,)}
    layer = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (h, h), "attn_k": (h, kv), "attn_v": (h, kv)}
    layer.update(attn_output=(h, h), ffn_gate=(h, f), ffn_up=(h, f), ffn_down=(f, h))
    tensors.update({f"blk.0.{name}.weight": shape for name, shape in layer.items()})
    tensors.update(shapes or {})
    rng = np.random.default_rng(0)
    for name, shape in tensors.items():  # ggml order in, NumPy order written
        values = rng.standard_normal(tuple(reversed(shape))).astype(np.float32)
        dtype = (dtypes or {}).get(name, np.float32)
        if isinstance(dtype, gguf.GGMLQuantizationType):  # quantized by gguf, written as its bytes
            writer.add_tensor(name, gguf.quants.quantize(values, dtype), raw_dtype=dtype)
        else:
            writer.add_tensor(name, values.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate:
        data = target.read_bytes()
        target.write_bytes(data[:-truncate])
    return target


def _kind(value: str | bool):
    import gguf

    return gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.STRING

"""GGUF files made in tests: a copy of a model with some metadata replaced (as llama.cpp's
gguf-new-metadata does), written with gguf's own writer."""

from __future__ import annotations

from pathlib import Path


def copy_with_metadata(source: Path, target: Path, replace: dict[str, str]) -> Path:
    """Copy GGUF `source` to `target`, string fields in `replace` set to the given values."""
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
            writer.add_key_value(field.name, value, gguf.GGUFValueType.STRING)
        else:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, value in pending.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return target

"""A trace with its instances renamed as a real engine names them: vLLM's 19-digit `instance_id` (no connector) or
a connector's uuid `engine_id`, in the `instance` column, the folders and the `remote_instance` details.

`renamed(src, dst, {"prefill-0": "1796642343414415538", ...})` copies the trace at `src` (its part files, each
rewritten, and the manifest) to `dst`, with the roles optionally rewritten too (`roles=`), and returns `dst`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pdtrace.format import MANIFEST_NAME

#: ids as vLLM makes them: two `instance_id`s (time.time_ns(), 0.28+) and a NIXL engine_id (uuid4)
ID_P = "1796642343414415538"
ID_D = "1796642343414415539"
UUID = "0e6f2c8a-4b1d-4c2e-9a7f-3d5b6c7e8f90"


def _mapped(column: pa.ChunkedArray, mapping: dict[str, str]) -> pa.Array:
    values = column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column
    return pa.array([None if v is None else mapping.get(v, v) for v in values.to_pylist()],
                    pa.string()).dictionary_encode()


def _detail(column: pa.ChunkedArray, mapping: dict[str, str]) -> pa.Array:
    out = []
    for text in column.to_pylist():
        if text:
            for old, new in mapping.items():
                text = text.replace(json.dumps(old), json.dumps(new))
        out.append(text)
    return pa.array(out, pa.string())


def renamed(src: Path, dst: Path, mapping: dict[str, str], roles: dict[str, str] | None = None) -> Path:
    """Copy the trace at `src` to `dst` with its instance ids renamed by `mapping` (and roles by `roles`, per old
    instance id); the folder of each writer follows its instance's new id."""
    src, dst = Path(src), Path(dst)
    for path in sorted(src.rglob("*.parquet")):
        parquet = pq.ParquetFile(path)
        table = parquet.read()
        old = table.column("instance").cast(pa.string()).to_pylist()
        fields = {name: table.column(name) for name in table.column_names}
        fields["instance"] = _mapped(table.column("instance"), mapping)
        if roles:
            role = table.column("role").cast(pa.string()).to_pylist()
            fields["role"] = pa.array([roles.get(i, r) for i, r in zip(old, role)], pa.string()).dictionary_encode()
        fields["detail"] = _detail(table.column("detail"), mapping)
        out = pa.Table.from_arrays([pa.chunked_array([fields[n]]) if not isinstance(fields[n], pa.ChunkedArray)
                                    else fields[n] for n in table.column_names], schema=table.schema)
        rel = path.relative_to(src)
        parts = list(rel.parts)
        parts[0] = mapping.get(parts[0], parts[0])
        target = dst.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(out, target, compression="zstd")
    manifest = src / MANIFEST_NAME
    if manifest.exists():
        text = manifest.read_text()
        for old_id, new_id in mapping.items():
            text = text.replace(json.dumps(old_id), json.dumps(new_id))
        (dst / MANIFEST_NAME).write_text(text)
    else:
        dst.mkdir(parents=True, exist_ok=True)
    return dst


__all__ = ["renamed", "ID_P", "ID_D", "UUID"]

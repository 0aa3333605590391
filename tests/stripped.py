"""Strip a trace of the optional fields and kinds its other events already imply (docs/trace-format.md).

`strip(table, parts)` is what a recorder that cannot read them (another engine, a release whose internals differ, a
hand-made trace, a recording that started late or lost a part file) would have written:
- `status`: null `status` on the aggregated completions (`kv_send_done`, `kv_recv_done`);
- `expected_ranks`: the detail key of those completions;
- `engine_config`: the rows of that kind;
- `delay_free`: null `delay_free` on `req_finish` of requests whose `req_add` detail says `remote_decode` or
  `remote_prefill` (the connector's decision follows from that and the finish);
- `remote_read`: the rows of that kind;
- `worker`: every worker / connector row (`exec_begin`, `exec_end`, `kv_send_rank`, `kv_recv_rank`, `batch_add`,
  `batch_remove`, `remote_read`);
- `trim`: the detail of sliding-window trims (`blocks_free` reason `skipped`: window, block_size, upto, tokens,
  computed), which recorders before pdtrace 0.1's trim facts did not write.
"""

from __future__ import annotations

import json
from typing import Iterable

import pyarrow as pa
import pyarrow.compute as pc

PARTS = ("status", "expected_ranks", "engine_config", "delay_free", "remote_read", "worker", "trim")
WORKER_KINDS = ("exec_begin", "exec_end", "kv_send_rank", "kv_recv_rank", "batch_add", "batch_remove",
                "remote_read")
COMPLETIONS = ("kv_send_done", "kv_recv_done")


def _text(table: pa.Table, name: str) -> list:
    col = table.column(name)
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col.to_pylist()


def _replace(table: pa.Table, name: str, values: list) -> pa.Table:
    field = table.schema.field(name)
    arr = pa.array(values, pa.string()).dictionary_encode() if pa.types.is_dictionary(field.type) else \
        pa.array(values, field.type)
    if pa.types.is_dictionary(field.type):
        arr = arr.cast(field.type)
    return table.set_column(table.schema.get_field_index(name), field, arr)


def strip(table: pa.Table, parts: Iterable[str] = PARTS) -> pa.Table:
    """The table without the given optional parts (see the module docstring); rows keep their order."""
    parts = set(parts)
    unknown = parts - set(PARTS)
    assert not unknown, unknown
    kinds = _text(table, "kind")
    drop = set()
    if "engine_config" in parts:
        drop.add("engine_config")
    if "remote_read" in parts:
        drop.add("remote_read")
    if "worker" in parts:
        drop.update(WORKER_KINDS)
    if drop:
        table = table.filter(pa.array([k not in drop for k in kinds]))
        kinds = _text(table, "kind")
    if "status" in parts:
        status = _text(table, "status")
        table = _replace(table, "status", [None if k in COMPLETIONS else s for k, s in zip(kinds, status)])
    if "expected_ranks" in parts:
        details = _text(table, "detail")
        out = []
        for kind, d in zip(kinds, details):
            if kind in COMPLETIONS and d:
                obj = json.loads(d)
                if isinstance(obj, dict) and "expected_ranks" in obj:
                    obj.pop("expected_ranks")
                    d = json.dumps(obj) if obj else None
            out.append(d)
        table = _replace(table, "detail", out)
    if "trim" in parts:
        details = _text(table, "detail")
        reasons = _text(table, "reason")
        table = _replace(table, "detail", [None if k == "blocks_free" and r == "skipped" else d
                                           for k, r, d in zip(kinds, reasons, details)])
    if "delay_free" in parts:
        details = _text(table, "detail")
        inst, dp, req = _text(table, "instance"), table.column("dp_rank").to_pylist(), _text(table, "req")
        remote = set()
        for kind, d, key in zip(kinds, details, zip(inst, dp, req)):
            if kind == "req_add" and d:
                obj = json.loads(d)
                if isinstance(obj, dict) and ("remote_decode" in obj or "remote_prefill" in obj):
                    remote.add(key)
        delay = table.column("delay_free").to_pylist()
        table = _replace(table, "delay_free", [None if k == "req_finish" and key in remote else v
                                               for k, key, v in zip(kinds, zip(inst, dp, req), delay)])
    return table

"""The validator names the first violation of the trace format: file, row, column, expected, found."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pdtrace.errors import TraceError
from pdtrace.format import SCHEMA, file_metadata
from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.reader import normalize_table
from pdtrace.trace.validate import check_metadata, check_schema, validate_file, validate_table


def good_table() -> pa.Table:
    b = EventBuilder(instance="P", role="prefill")
    b.add("req_add", req="r1", n=40)
    b.add("sched", step=0, n=40)
    b.add("blocks_alloc", step=0, req="r1", blocks=[1, 2, 3])
    b.add("req_finish", step=1, req="r1", reason="stop", status="RUNNING", delay_free=False)
    b.add("blocks_free", step=1, req="r1", blocks=[1, 2, 3], reason="finished", deferred=False)
    b.add("exec_begin", step=0, pp_rank=0, tp_rank=0, n=40)
    return b.table()


def replace(table: pa.Table, name: str, values: list, type_: pa.DataType | None = None) -> pa.Table:
    index = table.schema.get_field_index(name)
    array = pa.array(values, type_ or pa.string())
    if pa.types.is_dictionary(SCHEMA.field(name).type) and type_ is None:
        array = array.dictionary_encode()
    return table.set_column(index, pa.field(name, array.type), array)


def error_of(table: pa.Table, **kwargs) -> str:
    with pytest.raises(TraceError) as info:
        validate_table(table, where="t.parquet", **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_good_table_passes_without_notes():
    assert validate_table(good_table(), where="t.parquet") == []


def test_wrong_type_is_named():
    table = good_table()
    table = replace(table, "ts_ns", [str(v) for v in table.column("ts_ns").to_pylist()], pa.string())
    assert error_of(table) == "t.parquet: column 'ts_ns': expected int64, found string"


def test_wrong_list_item_type_is_named():
    table = good_table()
    blocks = [None if v is None else [str(x) for x in v] for v in table.column("blocks").to_pylist()]
    message = error_of(replace(table, "blocks", blocks, pa.list_(pa.string())))
    assert "column 'blocks': expected list<item: int32>" in message and "found list<item: string>" in message


def test_missing_column_is_named():
    message = error_of(good_table().drop_columns(["kind"]))
    assert message == "t.parquet: missing column 'kind' (expected dictionary<string>)"


def test_null_in_non_null_column_names_row_and_column():
    table = good_table()
    pids = table.column("pid").to_pylist()
    pids[2] = None
    message = error_of(replace(table, "pid", pids, pa.int32()))
    assert message == "t.parquet: row 2, column 'pid': expected a value, found null"


def test_unknown_role_is_named():
    table = good_table()
    roles = table.column("role").to_pylist()
    roles[1] = "master"
    message = error_of(replace(table, "role", roles))
    assert message.startswith("t.parquet: row 1, column 'role': expected one of both, decode, none, prefill")
    assert message.endswith("found 'master'")


def test_unknown_component_is_named():
    table = good_table()
    components = table.column("component").to_pylist()
    components[4] = "gpu"
    message = error_of(replace(table, "component", components))
    assert message.startswith("t.parquet: row 4, column 'component'") and "found 'gpu'" in message


def test_reason_outside_the_kinds_vocabulary_is_named():
    table = good_table()
    reasons = table.column("reason").to_pylist()
    reasons[3] = "finished"  # a blocks_free reason on req_finish
    message = error_of(replace(table, "reason", reasons))
    assert message.startswith("t.parquet: row 3, column 'reason': expected one of abort, error, length")
    assert "for kind 'req_finish', found 'finished'" in message


def test_reason_is_free_for_kinds_without_a_vocabulary_and_may_be_null():
    table = good_table()
    reasons = table.column("reason").to_pylist()
    reasons[0] = "anything"  # req_add: the format fixes no reason vocabulary
    reasons[3] = None  # req_finish without a reason: allowed (nullable column)
    assert validate_table(replace(table, "reason", reasons), where="t") == []


def test_the_lowest_row_is_reported_first():
    table = good_table()
    roles = table.column("role").to_pylist()
    roles[4] = "master"
    pids = table.column("pid").to_pylist()
    pids[3] = None
    table = replace(replace(table, "role", roles), "pid", pids, pa.int32())
    assert "row 3, column 'pid'" in error_of(table)


def test_unknown_kind_is_a_note_not_an_error():
    table = good_table()
    kinds = table.column("kind").to_pylist()
    kinds[1] = "kv_teleport"
    notes = validate_table(replace(table, "kind", kinds), where="t.parquet")
    assert len(notes) == 1
    assert "kv_teleport" in notes[0] and "(1 rows)" in notes[0]


def test_bad_value_only_in_an_unused_dictionary_entry_is_not_a_violation():
    table = good_table()
    roles = pa.DictionaryArray.from_arrays(pa.array([1] * table.num_rows, pa.int32()), ["master", "prefill"])
    assert validate_table(table.set_column(3, "role", roles), where="t") == []


def test_unknown_schema_version_is_an_error():
    metadata = file_metadata("0.9", "synthetic", 0)
    metadata[b"pdtrace.schema_version"] = b"2"
    message = error_of(good_table(), metadata=metadata)
    assert message.startswith("t.parquet: unknown trace schema version '2'")


def test_missing_schema_version_is_an_error_when_metadata_is_required():
    assert "no 'pdtrace.schema_version'" in error_of(good_table(), require_metadata=True)


def test_metadata_is_decoded():
    info, notes = check_metadata(file_metadata("0.1.0", "dryrun", 12), "f")
    assert info == {"schema_version": "1", "pdtrace_version": "0.1.0", "source": "dryrun", "dropped_events": 12,
                    "window_start_ns": None}
    assert notes == []
    dump = file_metadata("0.1.0", "dryrun", 0)
    dump[b"pdtrace.window_start_ns"] = b"1700000000000000000"
    assert check_metadata(dump, "f")[0]["window_start_ns"] == 1_700_000_000_000_000_000
    dump[b"pdtrace.window_start_ns"] = b"soon"
    info, notes = check_metadata(dump, "f")
    assert info["window_start_ns"] is None and "not a timestamp" in notes[0]
    metadata = file_metadata("0.1.0", "dryrun", 0)
    metadata[b"pdtrace.dropped_events"] = b"lots"
    info, notes = check_metadata(metadata, "f")
    assert info["dropped_events"] == 0 and "not a count" in notes[0]


def test_accepted_type_variants_normalise_to_the_format_schema():
    table = good_table()
    variants = {}
    for field in SCHEMA:
        column = table.column(field.name)
        if pa.types.is_dictionary(field.type):
            column = column.cast(pa.large_string())
        elif field.name == "req":
            column = column.dictionary_encode()
        elif field.name == "blocks":
            column = column.cast(pa.large_list(pa.int64()))
        elif pa.types.is_integer(field.type):
            column = column.cast(pa.int64())
        variants[field.name] = column
    variant = pa.table(variants)
    assert check_schema(variant.schema, "v") == []
    assert validate_table(variant, where="v") == []
    normal = normalize_table(variant)
    assert normal.schema.equals(SCHEMA)
    assert normal.to_pylist() == table.to_pylist()


def test_all_null_columns_of_null_type_are_accepted_where_nullable():
    table = good_table()
    nulls = pa.nulls(table.num_rows)
    variant = table.set_column(table.schema.get_field_index("tp_rank"), "tp_rank", nulls)
    assert validate_table(variant, where="v") == []
    normal = normalize_table(variant)
    assert normal.schema.equals(SCHEMA) and normal.column("tp_rank").null_count == table.num_rows
    bad = table.set_column(table.schema.get_field_index("pid"), "pid", nulls)
    assert error_of(bad) == "t.parquet: column 'pid': expected int32, found null"


def test_extra_columns_are_a_note():
    table = good_table().append_column("gpu_id", pa.array([0] * 6))
    notes = validate_table(table, where="t")
    assert notes == ["t: columns unknown to this pdtrace ignored: gpu_id"]


def test_validate_file_names_the_file(tmp_path):
    table = good_table()
    pids = table.column("pid").to_pylist()
    pids[5] = None
    path = tmp_path / "part-000000.parquet"
    pq.write_table(replace(table, "pid", pids, pa.int32()).replace_schema_metadata(
        file_metadata("t", "synthetic", 0)), path)
    with pytest.raises(TraceError, match=r"part-000000\.parquet: row 5, column 'pid'"):
        validate_file(str(path))
    good = tmp_path / "good.parquet"
    pq.write_table(table.replace_schema_metadata(file_metadata("t", "synthetic", 0)), good)
    assert validate_file(str(good)) == []

"""Request codes from the reader's Parquet dictionary match the codes from hashing the `req` strings; rows taken
chunk by chunk match a chunked take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from pdtrace.analysis.columns import Columns, _first_seen_codes, dictionary_codes
from pdtrace.trace.model import take_rows
from pdtrace.trace.reader import REQ_DICTIONARY_ATTR, open_trace

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def _sample_trace() -> Path:
    for folder in sorted(SAMPLES.glob("*/trace")):
        if any(folder.rglob("*.parquet")):
            return folder
    pytest.skip("no sample trace present")


@pytest.mark.parametrize("instances", [None, "first"])
def test_codes_from_reader_dictionary_equal_hashed_codes(instances: str | None) -> None:
    path = _sample_trace()
    wanted = None
    if instances:
        names = open_trace(path, columns=["instance"], warn=False).table.column("instance")
        wanted = str(names.chunk(0)[0])
    trace = open_trace(path, instances=wanted, warn=False)
    assert getattr(trace, REQ_DICTIONARY_ATTR)[0] is trace.table
    codes, names = Columns(trace).codes("req")
    want_codes, want_names = dictionary_codes(trace.table.column("req"))
    assert names == want_names
    np.testing.assert_array_equal(codes, want_codes)
    assert codes.dtype == want_codes.dtype


def test_first_seen_codes_renumbers_an_unordered_dictionary_and_drops_unused_names() -> None:
    dictionary = pa.array(["unused", "req-b", "req-a", "req-c"])
    chunks = [pa.DictionaryArray.from_arrays(pa.array([2, None, 1, 2], pa.int32()), dictionary),
              pa.DictionaryArray.from_arrays(pa.array([3, 1], pa.int32()), dictionary)]
    column = pa.chunked_array(chunks)
    codes, names = _first_seen_codes(column, 6)
    assert names == ["req-a", "req-b", "req-c"]
    np.testing.assert_array_equal(codes, [0, -1, 1, 0, 2, 1])
    want_codes, want_names = dictionary_codes(column.cast(pa.string()))
    assert names == want_names
    np.testing.assert_array_equal(codes, want_codes)


def test_a_replaced_table_is_not_read_through_the_kept_dictionary() -> None:
    trace = open_trace(_sample_trace(), warn=False)
    trace.table = trace.table.slice(1)
    codes, names = Columns(trace).codes("req")
    want_codes, want_names = dictionary_codes(trace.table.column("req"))
    assert names == want_names
    np.testing.assert_array_equal(codes, want_codes)


def test_first_seen_codes_unifies_chunks_with_different_dictionaries() -> None:
    chunks = [pa.DictionaryArray.from_arrays(pa.array([1, 0, None], pa.int32()), pa.array(["req-x", "req-y"])),
              pa.DictionaryArray.from_arrays(pa.array([0, 2, None, 1], pa.int32()),
                                             pa.array(["req-z", "req-x", "req-w"])),
              pa.DictionaryArray.from_arrays(pa.array([1], pa.int32()), pa.array(["req-x", "req-y"]))]
    column = pa.chunked_array(chunks)
    codes, names = _first_seen_codes(column, 8)
    assert names == ["req-y", "req-x", "req-z", "req-w"]
    np.testing.assert_array_equal(codes, [0, 1, -1, 2, 3, -1, 1, 0])
    want_codes, want_names = dictionary_codes(column.cast(pa.string()))
    assert names == want_names
    np.testing.assert_array_equal(codes, want_codes)


def test_first_seen_codes_of_a_cut_row_group_match_hashed_codes_and_leave_the_column_unchanged() -> None:
    dictionary = pa.array(["gone", "req-b", "req-a"])  # a row group's dictionary, its first rows cut off
    chunks = [pa.DictionaryArray.from_arrays(pa.array([2, 1], pa.int32()), dictionary),
              pa.DictionaryArray.from_arrays(pa.array([1, 2], pa.int32()), pa.array(["req-x", "req-b", "req-a"])),
              pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array(["req-c", "req-a"]))]
    column = pa.chunked_array(chunks)
    before = column.to_pylist()
    codes, names = _first_seen_codes(column, 6)
    want_codes, want_names = dictionary_codes(column.cast(pa.string()))
    assert names == want_names == ["req-a", "req-b", "req-c"]
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(codes, [0, 1, 1, 0, 2, 0])
    assert column.to_pylist() == before


@pytest.mark.parametrize("rows", [[0], [5, 0, 3, 3, 1], [], [2, 3, 4, 5], [4, 2]])
def test_take_rows_matches_chunked_take(rows: list[int]) -> None:
    column = pa.chunked_array([pa.array(["a", None, "c"]), pa.array([], pa.string()), pa.array(["d", "e"]),
                               pa.array(["f"])])
    picked = np.array(rows, np.int64)
    assert take_rows(column, picked).to_pylist() == column.take(pa.array(picked)).to_pylist()


@pytest.mark.parametrize("since", [False, True])
def test_a_trace_read_with_req_as_dictionary_holds_the_same_rows_and_codes(since: bool) -> None:
    # open_trace(req_dictionary=True), as the windows read: `req` stays dictionary<int32, string> with each row
    # group's own dictionary (never unified), the other columns as the plain read gives them, and the request codes
    # of the analyses the same
    from pdtrace.trace.reader import REQ_DICTIONARY_TYPE

    path = SAMPLES / "healthy_pd_pp1" / "trace"
    plain = open_trace(path, warn=False)
    cut = int(np.sort(plain.table.column("ts_ns").to_numpy())[len(plain) // 3]) if since else None
    plain = open_trace(path, warn=False, since_ns=cut)
    coded = open_trace(path, warn=False, since_ns=cut, req_dictionary=True)
    assert coded.table.schema.field("req").type == REQ_DICTIONARY_TYPE
    assert plain.table.schema.field("req").type == pa.string()
    assert coded.table.column("req").num_chunks > 1
    assert len({id(chunk.dictionary) for chunk in coded.table.column("req").chunks}) > 1  # not unified
    assert coded.table.column("req").cast(pa.string()).to_pylist() == plain.table.column("req").to_pylist()
    assert coded.table.drop_columns(["req"]).equals(plain.table.drop_columns(["req"]))
    assert getattr(coded, REQ_DICTIONARY_ATTR)[0] is coded.table
    got, want = Columns(coded).codes("req"), Columns(plain).codes("req")
    assert got[1] == want[1]
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("req_type", [pa.large_string(), pa.string(), pa.dictionary(pa.int8(), pa.large_string())])
def test_normalize_keeps_any_string_req_as_the_one_dictionary_type(req_type: pa.DataType) -> None:
    # every run of files read for a window must give `req` one type, or their tables would not concatenate
    from pdtrace.trace.reader import REQ_DICTIONARY_TYPE, normalize_table

    table = open_trace(SAMPLES / "healthy_pd_pp1" / "trace", warn=False).table
    names = table.column("req")
    other = table.set_column(table.column_names.index("req"), pa.field("req", req_type), names.cast(req_type))
    got = normalize_table(other, req_dictionary=True)
    assert got.schema.field("req").type == REQ_DICTIONARY_TYPE
    assert got.column("req").cast(pa.string()).to_pylist() == names.to_pylist()
    assert normalize_table(other).schema.field("req").type == pa.string()


def test_a_req_column_of_codes_gives_the_hashed_codes_without_the_kept_indices(monkeypatch: Any) -> None:
    # a window's table (`PathSource.rows`) concatenates reads whose req is dictionary<int32, string>, one dictionary
    # per row group, and holds no kept indices: Columns takes the codes from the column itself, by first
    # appearance, never through `dictionary_codes` (which unifies the row groups' dictionaries: a hash of each name)
    from pdtrace.analysis import columns as C

    path = SAMPLES / "healthy_pd_pp1" / "trace"
    coded = open_trace(path, warn=False, req_dictionary=True)
    plain = open_trace(path, warn=False)
    want = Columns(plain).codes("req")
    delattr(coded, REQ_DICTIONARY_ATTR)
    monkeypatch.setattr(C, "dictionary_codes", lambda column: pytest.fail("req's names hashed"))
    got = Columns(coded).codes("req")
    assert got[1] == want[1]
    np.testing.assert_array_equal(got[0], want[0])

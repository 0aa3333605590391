"""Request codes from the reader's Parquet dictionary match the codes from hashing the `req` strings; rows taken
chunk by chunk match a chunked take."""

from __future__ import annotations

from pathlib import Path

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

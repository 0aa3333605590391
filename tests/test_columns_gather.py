"""Columns.ints_at / numbers_at / bools_at read a column at a few rows straight from the chunks' buffers: the same
values as the whole column converted, for rows in any order, across chunk boundaries, with nulls and offsets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pdtrace.analysis.columns import gather


def _chunked(values: list, typ: pa.DataType, cuts: list[int]) -> pa.ChunkedArray:
    whole = pa.array(values, typ)
    # slices give chunks with non-zero offsets into shared buffers, as Arrow's readers do
    bounds = [0, *cuts, len(values)]
    return pa.chunked_array([whole.slice(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])], typ)


@pytest.mark.parametrize("typ", [pa.int64(), pa.int16(), pa.bool_()])
def test_gather_matches_the_whole_column(typ: pa.DataType) -> None:
    rng = np.random.default_rng(7)
    n = 1000
    raw = rng.integers(0, 50, n)
    values = [None if v % 7 == 0 else (bool(v % 2) if typ == pa.bool_() else int(v)) for v in raw]
    column = _chunked(values, typ, [3, 250, 251, 999])
    for rows in (np.arange(n), rng.integers(0, n, 300), np.array([999, 0, 3, 2, 250, 250]), np.array([], int)):
        got, valid = gather(column, rows)
        expected = [values[r] for r in rows]
        assert valid.tolist() == [v is not None for v in expected]
        assert [g for g, ok in zip(got.tolist(), valid) if ok] == [v for v in expected if v is not None]


def test_ints_numbers_and_bools_at_rows(tmp_path) -> None:
    from pdtrace.analysis.columns import Columns
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder()
    b.add("req_add", req="a", n=16)
    b.add("req_sched", req="a", step=0)  # n null
    b.add("req_finish", req="a", step=0, delay_free=True, reason="length")
    b.add("req_finish", req="b", step=1, reason="length")  # delay_free null
    cols = Columns(b.trace())
    rows = np.array([3, 0, 1, 2])
    assert cols.ints_at("n", rows).tolist() == [-1, 16, -1, -1]
    assert cols.ints_at("n", rows, fill=-9).tolist() == [-9, 16, -9, -9]
    numbers = cols.numbers_at("n", rows)
    assert numbers[1] == 16.0 and np.isnan(numbers[[0, 2, 3]]).all()
    value, valid = cols.bools_at("delay_free", rows)
    assert valid.tolist() == [False, False, False, True] and bool(value[3]) is True

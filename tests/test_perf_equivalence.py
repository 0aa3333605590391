"""The fast paths of pdtrace.analysis.columns give what their plain definitions give (random inputs, seeded;
sample traces)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pdtrace.analysis.columns import (_CHECK_BLOCK, Columns, _numbered_by_first_seen, first_per_key, last_per_key,
                                     order_by_key, order_by_pair)
from pdtrace.trace.model import Trace
from pdtrace.trace.reader import open_trace


def _numbered_by_running_max(raw: np.ndarray, size: int) -> bool:
    running = np.maximum.accumulate(raw)
    return bool(int(running[-1]) == size - 1 and int(running[0]) <= 0 and not (running[1:] - running[:-1] > 1).any())


def _first_seen_numbering(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    values = rng.integers(0, k, n)
    _, first = np.unique(values, return_index=True)
    lut = np.empty(k, np.int64)
    lut[values[np.sort(first)]] = np.arange(len(first))
    raw = lut[values].astype(np.int32)
    raw[rng.random(n) < 0.1] = -1
    return raw


@pytest.mark.parametrize("seed", range(4))
def test_blockwise_first_seen_check_matches_the_running_maximum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    outcomes = set()
    for trial in range(400):
        n = int(rng.integers(1, 5 * _CHECK_BLOCK))
        k = int(rng.integers(1, 80))
        raw = _first_seen_numbering(rng, n, k) if trial % 4 else rng.integers(-1, k, n).astype(np.int32)
        if trial % 4 == 2:  # one code off by a little
            i = rng.integers(0, n)
            raw[i] += rng.integers(-1, 3)
        if trial % 4 == 3:  # two rows swapped
            i, j = rng.integers(0, n, 2)
            raw[[i, j]] = raw[[j, i]]
        size = int(raw.max()) + 1 + (trial % 7 == 0)
        expected = _numbered_by_running_max(raw, size)
        outcomes.add(expected)
        assert _numbered_by_first_seen(raw, size) == expected, (trial, n, size)
    assert outcomes == {True, False}


def test_first_seen_check_refuses_a_late_jump_in_a_later_block() -> None:
    raw = np.repeat(np.arange(10, dtype=np.int32), _CHECK_BLOCK)  # 0..9, one block each: numbered by first sight
    assert _numbered_by_first_seen(raw, 10)
    raw[5 * _CHECK_BLOCK + 3] = 7  # 7 seen before 6
    assert not _numbered_by_first_seen(raw, 10)
    assert not _numbered_by_first_seen(np.repeat(np.arange(10, dtype=np.int32), 3), 11)  # code 10 unused


SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


@pytest.mark.parametrize("sample", ["starve", "few_requests_pp", "healthy_pd_pp1"])
def test_row_lists_of_kinds_equal_a_pass_over_every_kind(sample: str) -> None:
    path = SAMPLES / sample / "trace"
    if not path.is_dir():
        pytest.skip("sample trace not present")
    cols = Columns(open_trace(path, warn=False))
    codes, names = cols.codes("kind")
    major = cols._kind_split[0]
    queries = [(k,) for k in names] + [(names[major], k) for k in names if k != names[major]][:3] + \
        [tuple(names[:3]), ("not_a_kind",), (names[major], "not_a_kind")]
    for kinds in queries:
        wanted = np.isin(codes, [names.index(k) for k in kinds if k in names])
        rows = cols.rows_of(*kinds)
        np.testing.assert_array_equal(rows, np.flatnonzero(wanted), err_msg=str(kinds))
        assert rows.dtype == np.int32
        np.testing.assert_array_equal(cols.req_rows(*kinds), np.flatnonzero(wanted & (cols.rk >= 0)),
                                      err_msg=str(kinds))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("sentinels", [False, True])
def test_first_and_last_per_key_equal_an_int64_reduction(dtype: type, sentinels: bool) -> None:
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 50, 2000).astype(np.int32)
    values = rng.integers(-5, 10_000, 2000).astype(dtype)
    if sentinels:  # the int32 sentinels are ordinary values
        values[:3] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min, 0]
    n_keys = 60  # keys 50..59 have no value: fill
    for ours, reduce, empty in ((first_per_key, np.minimum, np.iinfo(np.int64).max),
                                (last_per_key, np.maximum, np.iinfo(np.int64).min)):
        want = np.full(n_keys, empty, np.int64)
        reduce.at(want, keys, values.astype(np.int64))
        want[want == empty] = -7
        got = ours(keys, values, n_keys, fill=-7)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


def _sched_keys_by_bincount(cols: Columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plain definition: (instance, dp) combined, a bincount of every row, a lookup table."""
    inst, _ = cols.codes("instance")
    width = int(cols.dp.max()) + 2
    combined = inst.astype(np.int32) * np.int32(width) + cols.dp + 1
    present = np.flatnonzero(np.bincount(combined))
    lut = np.full(int(present[-1]) + 1, -1, np.int64)
    lut[present] = np.arange(len(present))
    return lut[combined], present // width, present % width - 1


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_keys_by_blocks_equal_a_bincount_of_every_row(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_runs = 40
    lengths = rng.choice([1, 7, 300, 1500, 5000], n_runs)  # writers' runs: some shorter than a block, some longer
    instance = np.repeat(rng.choice(["P", "D", "E"], n_runs), lengths)
    dp = np.repeat(rng.integers(-1, 3, n_runs), lengths)
    flip = rng.random(len(dp)) < 0.001  # a few rows of another dp inside a run
    dp[flip] = 2
    table = pa.table({"instance": pa.array(instance), "dp_rank": pa.array(dp, pa.int16(), mask=dp < 0)})
    cols = Columns(Trace(table=table))
    sk, inst_of, dp_of = cols._sched_keys
    want_sk, want_inst, want_dp = _sched_keys_by_bincount(cols)
    np.testing.assert_array_equal(sk, want_sk)
    np.testing.assert_array_equal(inst_of, want_inst)
    np.testing.assert_array_equal(dp_of, want_dp)
    assert inst_of.dtype == want_inst.dtype and sk.dtype == np.int16


def test_running_count_restarts_at_each_run_of_keys() -> None:
    from pdtrace.analysis.blocks import _running_count

    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 17, 500):
        key = np.sort(rng.integers(0, max(n // 4, 1), n)).astype(np.int64)
        delta = rng.choice([1, -1], n).astype(np.int64)
        want = np.empty(n, np.int64)
        for i in range(n):  # the definition, on a tiny input
            want[i] = delta[i] + (want[i - 1] if i and key[i] == key[i - 1] else 0)
        np.testing.assert_array_equal(_running_count(key, delta), want)


def test_kind_split_equals_a_mask_of_the_common_kind() -> None:
    rng = np.random.default_rng(5)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        kinds = rng.choice(["a", "b", "c"], n, p=[0.7, 0.2, 0.1]) if trial % 3 else rng.choice(["a", "b"], n)
        cols = Columns(Trace(table=pa.table({"kind": pa.array(kinds)})))
        major, major_rows, minor_rows, minor_codes = cols._kind_split
        codes, _ = cols.codes("kind")
        np.testing.assert_array_equal(major_rows, np.flatnonzero(codes == major))
        np.testing.assert_array_equal(minor_rows, np.flatnonzero(codes != major))
        np.testing.assert_array_equal(minor_codes, codes[codes != major])
        assert major_rows.dtype == minor_rows.dtype == np.int32


def test_detail_values_of_a_few_rows_equal_the_arrow_extraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to FEW_ROWS rows, detail values come from Python's `re` with the same patterns as Arrow's kernels."""
    from pdtrace.analysis import steps
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder()
    details = [{"pp": 2, "tp": 1, "runner": "gpu"}, {"pp": 4.5, "flag": True, "runner": ""}, {"flag": False},
               None, {"pp": -3, "nested": {"tp": 7}}, {"pp": 1e3, "runner": "cpu \u00e9"}, {"tp": "8"}, {}]
    for detail in details:
        b.add("engine_config", n=100, detail=detail)
    ctx = AnalysisContext(b.trace())
    rows = np.arange(len(details))
    keys = ["pp", "tp", "flag", "absent"]
    few = steps.detail_numbers(ctx, rows, keys)
    few_text = {k: steps.detail_text(ctx, rows, k) for k in ("runner", "tp", "absent")}
    monkeypatch.setattr(steps, "FEW_ROWS", 0)
    arrow = steps.detail_numbers(ctx, rows, keys)
    for key in keys:
        np.testing.assert_array_equal(few[key], arrow[key], err_msg=key)
    for key, values in few_text.items():
        assert list(values) == list(steps.detail_text(ctx, rows, key)), key
    assert few["pp"][0] == 2 and few["flag"][1] == 1.0 and few["flag"][2] == 0.0 and np.isnan(few["pp"][3])


def test_order_by_pair_is_the_lexsort_or_none_when_already_in_order() -> None:
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(0, 60))
        primary = rng.integers(0, 4, n)
        secondary = rng.integers(0, 5, n)
        if trial % 2:  # already in order, ties included
            order = np.lexsort((secondary, primary))
            primary, secondary = primary[order], secondary[order]
        got = order_by_pair(primary, secondary)
        expected = np.lexsort((secondary, primary))
        if got is None:
            np.testing.assert_array_equal(expected, np.arange(n))
        else:
            np.testing.assert_array_equal(got, expected)
            assert not np.array_equal(expected, np.arange(n))


def test_order_by_key_is_the_lexsort_of_key_then_value() -> None:
    """The combined int64 key, and the lexsort it falls back to for negative keys or a span that would overflow."""
    rng = np.random.default_rng(5)
    for key_range, value_range in [((0, 5), (0, 9)), ((0, 3), (-(10**12), 10**12)), ((-3, 3), (0, 9)),
                                   ((0, 2**40), (0, 2**30)), ((0, 1), (0, 1))]:
        for n in (0, 1, 50, 3000):
            key = rng.integers(*key_range, n, endpoint=True)
            value = rng.integers(*value_range, n, endpoint=True)
            np.testing.assert_array_equal(order_by_key(key, value), np.lexsort((value, key)))

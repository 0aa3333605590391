"""The blocks and steps figures of a long trace (or a long window of it) are drawn piece by piece, and are the
figures of the whole load.

`plot --kind blocks` (or `steps`) on instances of more than --window-events events (default 15M, as `analyze`
windows them) reads the window (the whole trace where no --since/--until/--request is given) in pieces of about that
many events (`pdtrace.analysis.windows.plan_time_windows`), one at a time: each piece read as the windowed analysis
reads one of its windows (the requests open at its start from their first row, a leak older than it carried),
reduced per pixel of the whole window's axis, joined and reduced again (`pdtrace.plot.build_figure_in_pieces`). A
KV-cache usage that creeps up over six hours is drawn in the memory of a piece, not of the six hours.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.partitions import open_window_pieces
from pdtrace.analysis.windows import PathSource, plan_time_windows, read_time_window
from pdtrace.trace.reader import open_trace
from test_plot_window import _leak_then_traffic

ROOT = Path(__file__).resolve().parents[1]


def _pieces_drawn(err: str) -> int:
    found = re.findall(r"\(piece (\d+)/(\d+)\)", err)
    return int(found[-1][1]) if found else 1


def _span_s(path: Path) -> float:
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    return (int(ts.max()) - int(ts.min())) / 1e9


def _plot_both(cli: Any, tmp_path: Path, path: Path, kind: str, pieces_at: int,
               *args: str) -> tuple[bytes, bytes, int]:
    """(the image in pieces of `pieces_at` events, the whole load's image, how many pieces were drawn)."""
    images, drawn = [], 1
    for window_events in (pieces_at, 0):
        out = tmp_path / f"{kind}-{window_events}.png"
        result = cli("plot", path, "--kind", kind, *args, "--window-events", window_events, "-o", out)
        assert result.exit_code == 0, result.stderr
        images.append(out.read_bytes())
        if window_events:
            drawn = _pieces_drawn(result.stderr)
    return images[0], images[1], drawn


@pytest.mark.parametrize("kind", ["blocks", "steps"])
@pytest.mark.parametrize("few", [2000, 8])
def test_a_trace_with_an_old_leak_drawn_in_pieces_is_the_whole_loads(cli: Any, tmp_path: Path, few: int,
                                                                     kind: str) -> None:
    # few: at most how many points a line keeps unreduced (figures.FEW_POINTS); at 8 every piece, the joined
    # pieces and the whole load reduce theirs per pixel, as a long trace's do
    path = tmp_path / "trace"
    _leak_then_traffic(steps=200, long=True).write(path)
    span = _span_s(path)
    with mock.patch("pdtrace.plot.figures.FEW_POINTS", few):
        for args in ([], ["--since", repr(0.3 * span)], ["--until", repr(0.6 * span)],
                     ["--since", repr(0.2 * span), "--until", repr(0.9 * span)], ["--request", "leak"],
                     ["--dpi", "20"]):
            pieced, whole, drawn = _plot_both(cli, tmp_path, path, kind, 150, *args)
            assert drawn >= 3, args  # it was drawn in pieces
            assert pieced == whole, args


@pytest.mark.parametrize("kind", ["blocks", "steps"])
@pytest.mark.parametrize("sample, few", [("few_requests_pp", 2000), ("lost_send_completion", 2000),
                                         ("healthy_pd_pp1", 2000), ("healthy_pd_pp1", 8), ("few_requests_pp", 8)])
def test_a_sample_drawn_in_pieces_is_the_whole_loads(cli: Any, tmp_path: Path, sample: str, few: int,
                                                      kind: str) -> None:
    # real vLLM engine cores on a simulated executor: several schedulers (a P/D pair), prefix-shared blocks
    path = ROOT / "sample_traces" / sample / "trace"
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    ts.sort()
    events, quarter = len(ts), (int(ts[len(ts) // 4]) - int(ts[0])) / 1e9  # a quarter of the events in
    for args in ([], ["--since", repr(quarter)]):
        with mock.patch("pdtrace.plot.figures.FEW_POINTS", few):  # at 8 every line is reduced per pixel
            pieced, whole, drawn = _plot_both(cli, tmp_path, path, kind, max(events // 6, 50), *args)
        assert drawn >= 3, (sample, args)
        assert pieced == whole, (sample, args)


def test_the_pieces_tile_the_window_and_only_the_last_reads_ahead(tmp_path: Path) -> None:
    path = tmp_path / "trace"
    _leak_then_traffic(steps=200).write(path)
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    t0, t1 = int(ts.min()), int(ts.max())
    config = AnalysisConfig(window_events=100)
    for since, until in ((None, None), (t0 + (t1 - t0) // 4, None), (None, t0 + (t1 - t0) // 2),
                         (t0 + (t1 - t0) // 5, t0 + (t1 - t0) * 4 // 5)):
        source = PathSource(str(path), None, None, config)
        pieces = plan_time_windows(source, since, until, config, piece_events=100)
        assert len(pieces) >= 3
        assert pieces[0].since == (t0 if since is None else since)
        assert pieces[-1].until == (t1 + 1 if until is None else until)
        for a, b in zip(pieces, pieces[1:]):
            assert a.until == b.since and a.end == a.until  # a piece reads to its own end, no further
        inside = ((ts >= pieces[0].since) & (ts < pieces[-1].until)).sum()
        sizes = [int(((ts >= p.since) & (ts < p.until)).sum()) for p in pieces]
        assert sum(sizes) == inside and max(sizes) <= 130, sizes  # about 100 events each
        last = pieces[-1]
        assert (last.end > until) if until is not None else last.window_end is None
        # one piece where none is asked for: the window read whole (`open_window`)
        (whole,) = plan_time_windows(source, since, until, config)
        assert whole.since == pieces[0].since and whole.start == pieces[0].start


def test_a_leak_carried_into_every_piece_is_read_once_and_each_piece_holds_what_a_fresh_read_does(
        tmp_path: Path) -> None:
    path = tmp_path / "trace"
    _leak_then_traffic(steps=200).write(path)
    config = AnalysisConfig(window_events=100)
    opened: list[pa.Table] = []
    real_open = PathSource._open

    def spy(self: PathSource, *args: Any, **kwargs: Any) -> Any:
        trace = real_open(self, *args, **kwargs)
        if "rows" in kwargs:  # a read of the rows outside a piece's own time: the carried and configuration rows
            opened.append(trace.table)
        return trace

    PathSource._open = spy  # type: ignore[method-assign]
    try:
        pieces = open_window_pieces(path, [], None, None, config, piece_events=100)
        assert pieces is not None and len(pieces) >= 5
        shared = [read() for _, read in pieces]
    finally:
        PathSource._open = real_open  # type: ignore[method-assign]
    carrying = [w for w, _ in pieces if "leak" in w.plan.carried[w.index]]
    assert len(carrying) >= 4  # the leak holds its blocks to the end: every later piece carries it
    leak_reads = sum(pc.sum(pc.equal(t.column("req").cast(pa.string()), "leak")).as_py() or 0 for t in opened)
    # its four rows (req_add, blocks_alloc, req_sched, req_finish), read by the first piece that carries it only
    assert leak_reads == 4
    for (window, _), table in zip(pieces, (t.table for t in shared)):
        fresh = read_time_window(PathSource(str(path), None, None, config), window).table

        def rows(t: pa.Table) -> list[tuple[Any, ...]]:
            t = t.select(["ts_ns", "seq", "kind", "req"])
            return sorted(zip(*(t.column(c).cast(pa.string()).to_pylist() for c in t.column_names)))

        assert rows(table) == rows(fresh)
        if "leak" in window.plan.carried[window.index]:
            assert "leak" in set(table.column("req").cast(pa.string()).to_pylist())


@pytest.mark.parametrize("damage", ["truncated", "corrupt page"])
def test_a_damaged_file_is_skipped_and_named_once_by_a_plot_in_pieces(cli: Any, tmp_path: Path,
                                                                       damage: str) -> None:
    # one writer's file cut short (no footer) or with a corrupt data page under an intact footer: the pieces skip
    # it as the whole load does, and say so once, not once a piece (nor, as a window read did, not at all)
    path = tmp_path / "trace"
    _leak_then_traffic(steps=200).write(path)
    first = max(path.rglob("*.parquet"), key=lambda f: f.stat().st_size)  # the scheduler's: most of the rows
    victim = first.parent / "part-999999.parquet"  # a copy of it, damaged: were it read, its rows would be twice
    data = bytearray(first.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        for i in range(len(data) // 4, len(data) // 4 + 400):
            data[i] ^= 0x5A
    victim.write_bytes(bytes(data))
    errors = []
    for window_events in (150, 0):
        out = tmp_path / f"blocks-{window_events}.png"
        result = cli("plot", path, "--kind", "blocks", "--window-events", window_events, "-o", out)
        assert result.exit_code == 0, result.stderr
        errors.append(result.stderr)
    assert _pieces_drawn(errors[0]) >= 3
    named = [line for line in errors[0].splitlines() if str(victim) in line]
    assert len(named) == 1 and "skipped" in named[0], errors[0]
    assert (tmp_path / "blocks-150.png").read_bytes() == (tmp_path / "blocks-0.png").read_bytes()
    # a time window read alone (export, one piece) names it too
    span = _span_s(path)
    result = cli("export", path, "--since", repr(0.5 * span), "--until", repr(0.6 * span), "--window-events", 150,
                 "-o", tmp_path / "w.json")
    assert result.exit_code == 0, result.stderr
    assert sum(str(victim) in line for line in result.stderr.splitlines()) == 1, result.stderr


def test_the_pieces_of_a_pd_pair_read_about_a_piece_each(cli: Any, tmp_path: Path) -> None:
    # a P/D pair is planned as one (its partitions' files): the two instances' step numbers are two sequences, so a
    # step is keyed by its instance too. Keyed by (dp_rank, step) alone, prefill's step k and decode's step k made
    # one "step" open from the first to the last of them, and as steps open at a cut are read whole, every piece
    # read back to the start (healthy_pd_pp1 in pieces of 200 events: 200, 346, ..., 1,792 rows)
    path = ROOT / "sample_traces" / "healthy_pd_pp1" / "trace"
    result = cli("plot", path, "--kind", "steps", "--window-events", 200, "-o", tmp_path / "s.png")
    assert result.exit_code == 0, result.stderr
    read = [int(n.replace(",", "")) for n in re.findall(r"for ([\d,]+) events \(piece", result.stderr)]
    assert len(read) >= 10 and max(read) <= 3 * 200, read  # a piece, its lookback (100) and its margin

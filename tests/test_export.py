"""`pdtrace export`: Chrome Trace Event JSON (and Perfetto protobuf when the optional package is there) with the
slices, counters and flows the analyses' tables say it should have."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.requests import request_table
from pdtrace.analysis.steps import exec_spans, step_table
from pdtrace.analysis.timelines import block_usage, request_phases
from pdtrace.cli.app import WindowOptions, window_options
from pdtrace.export import export
from pdtrace.plot import Window

from scenarios import healthy_pd, pp4_pipeline  # noqa: E402
from test_timelines import MS, T0, pd_scenario  # noqa: E402


def chrome(trace, tmp_path: Path, window: Window | None = None) -> dict:
    out = tmp_path / "out.json"
    export(AnalysisContext(trace), "chrome", out, window=window)
    return json.loads(out.read_text())


def by_ph(doc: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for event in doc["traceEvents"]:
        groups.setdefault(event["ph"], []).append(event)
    return groups


def names(doc: dict, kind: str) -> dict[tuple[int, int | None], str]:
    return {(e["pid"], e.get("tid")): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == kind}


SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def export_traces() -> list[tuple[str, object]]:
    """The sample traces (real dry runs) when the repository has them, and the hand-made scenarios."""
    makers: list[tuple[str, object]] = [("pd_scenario", lambda: pd_scenario().trace()), ("healthy_pd", healthy_pd),
                                        ("pp4_pipeline", pp4_pipeline)]
    if SAMPLES.is_dir():
        from pdtrace.trace.reader import open_trace

        for d in sorted(SAMPLES.iterdir()):
            if (d / "trace").is_dir() and any((d / "trace").rglob("*.parquet")):
                makers.append((d.name, lambda d=d: open_trace(d / "trace", warn=False)))
    return makers


@pytest.mark.parametrize("name,make", export_traces(), ids=[n for n, _ in export_traces()])
def test_chrome_export_has_one_slice_per_step_span_and_phase(tmp_path: Path, name: str, make) -> None:
    trace = make()
    doc = chrome(trace, tmp_path)
    ev = by_ph(doc)
    ctx = AnalysisContext(trace)
    # a transfer: a decode request that received its KV from a prefill request that finished (both in the trace)
    table = request_table(ctx)
    transfers = table.dropna(subset=["remote_req", "recv_done_ts"]).merge(
        table.dropna(subset=["finish_ts"])[["instance", "req"]].rename(
            columns={"instance": "remote_instance", "req": "remote_req"}))
    n_flows = len(transfers)
    assert len(ev.get("s", [])) == len(ev.get("f", [])) == n_flows
    expected_slices = (len(step_table(ctx)) + len(exec_spans(ctx).dropna(subset=["begin_ts", "end_ts"]))
                       + len(request_phases(ctx)) + 2 * n_flows)
    assert len(ev["X"]) == expected_slices
    assert len(ev["C"]) == len(block_usage(ctx))
    processes = names(doc, "process_name")
    instances = set(trace.events["instance"].astype(str))
    assert {v.split(" (")[0] for v in processes.values()} == instances
    # every slice and counter sits on a named process; every slice on a named thread
    threads = names(doc, "thread_name")
    assert all((e["pid"], None) in processes for e in ev["X"] + ev["C"])
    assert all((e["pid"], e["tid"]) in threads for e in ev["X"])
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in ev["X"])


def test_chrome_flow_goes_from_prefill_send_to_decode_receive(tmp_path: Path) -> None:
    doc = chrome(pd_scenario().trace(), tmp_path)
    ev = by_ph(doc)
    processes = {pid: name for (pid, _), name in names(doc, "process_name").items()}
    threads = names(doc, "thread_name")
    (s,), (f,) = ev["s"], ev["f"]
    assert s["id"] == f["id"] and f["bp"] == "e"
    assert processes[s["pid"]].startswith("prefill-0") and threads[(s["pid"], s["tid"])] == "req r1"
    assert processes[f["pid"]].startswith("decode-0") and threads[(f["pid"], f["tid"])] == "req d1"
    assert s["ts"] == pytest.approx(6.7 * 1000) and f["ts"] == pytest.approx(19 * 1000)  # r1's finish, d1's recv
    # each end lies inside a slice of its thread (what the viewer binds the arrow to)
    for end, mark in ((s, "kv send"), (f, "kv recv")):
        inside = [x for x in ev["X"] if (x["pid"], x["tid"]) == (end["pid"], end["tid"])
                  and x["ts"] <= end["ts"] <= x["ts"] + x["dur"]]
        assert mark in {x["name"] for x in inside}


def test_chrome_counters_carry_blocks_by_owner_state(tmp_path: Path) -> None:
    doc = chrome(pd_scenario().trace(), tmp_path)
    processes = {pid: name for (pid, _), name in names(doc, "process_name").items()}
    prefill = [e for e in by_ph(doc)["C"] if processes[e["pid"]].startswith("prefill-0")]
    assert [e["name"] for e in prefill] == ["KV blocks"] * len(prefill)
    peak = max(sum(e["args"].values()) for e in prefill)
    assert peak == 6
    assert set(prefill[0]["args"]) == {"running", "finished_awaiting_transfer", "leaked"}


def test_chrome_window_and_request_selection(tmp_path: Path) -> None:
    trace = pd_scenario().trace()
    whole = by_ph(chrome(trace, tmp_path))
    part = by_ph(chrome(trace, tmp_path, Window(since_s=0.005, until_s=0.010)))
    assert 0 < len(part["X"]) < len(whole["X"])
    assert all(5000 <= e["ts"] <= 10000 and e["ts"] + e["dur"] <= 10000 + 1e-6 for e in part["X"])
    assert all(5000 <= e["ts"] <= 10000 for e in part["C"])
    assert "s" not in part  # the transfer lands at 19 ms, outside the window

    doc = chrome(trace, tmp_path, Window(requests=("d1",)))
    request_threads = {v for v in names(doc, "thread_name").values() if v.startswith("req ")}
    assert request_threads == {"req d1", "req r1"}  # d1 and the prefill request it received from
    assert len(by_ph(doc)["s"]) == 1


def test_export_names_json_strings_safely(tmp_path: Path) -> None:
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance='odd"inst\\x', start_ns=T0)
    b.add("req_add", ts=T0, req='q"1\n', n=4)
    b.add("req_sched", ts=T0 + MS, step=0, req='q"1\n', n=4)
    doc = chrome(b.trace(), tmp_path)
    assert {v.split(" (")[0] for v in names(doc, "process_name").values()} == {'odd"inst\\x'}
    assert 'req q"1 ' in set(names(doc, "thread_name").values())


# --- Perfetto protobuf -----------------------------------------------------------------------------------------------


def test_perfetto_export_without_the_package_says_how_to_get_it(cli, tmp_path: Path, monkeypatch) -> None:
    trace_dir = pd_scenario().write(tmp_path / "t")
    monkeypatch.setitem(sys.modules, "perfetto", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "perfetto.trace_builder.proto_builder", None)
    r = cli("export", trace_dir, "--to", "perfetto", "-o", tmp_path / "x.pftrace")
    assert r.exit_code == 2
    assert "pip install perfetto" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.pftrace").exists()


def test_perfetto_export_parses_back_with_the_same_counts(tmp_path: Path) -> None:
    pytest.importorskip("perfetto.trace_builder.proto_builder")
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    out = tmp_path / "x.pftrace"
    model = export(AnalysisContext(pd_scenario().trace()), "perfetto", out)
    parsed = Trace()
    parsed.ParseFromString(out.read_bytes())
    types = Counter(p.track_event.type for p in parsed.packet if p.HasField("track_event"))
    assert types[TrackEvent.TYPE_SLICE_BEGIN] == types[TrackEvent.TYPE_SLICE_END] == len(model.slices)
    assert types[TrackEvent.TYPE_COUNTER] == 3 * len(model.counters)
    flows = [p.track_event for p in parsed.packet if p.track_event.flow_ids]
    ends = [p.track_event for p in parsed.packet if p.track_event.terminating_flow_ids]
    assert [e.name for e in flows] == ["kv send"] and [e.name for e in ends] == ["kv recv"]
    tracks = {p.track_descriptor.thread.thread_name for p in parsed.packet if p.HasField("track_descriptor")}
    assert {"req r1", "req d1", "dp0 PP1 TP0"} <= tracks
    # slices nest on each track: replaying begin/end never closes an unopened slice
    depth: Counter = Counter()
    for p in sorted((p for p in parsed.packet if p.HasField("track_event")), key=lambda p: p.timestamp):
        if p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN:
            depth[p.track_event.track_uuid] += 1
        elif p.track_event.type == TrackEvent.TYPE_SLICE_END:
            depth[p.track_event.track_uuid] -= 1
            assert depth[p.track_event.track_uuid] >= 0
    assert all(v == 0 for v in depth.values())


# --- CLI -------------------------------------------------------------------------------------------------------------


def test_cli_export_chrome(cli, tmp_path: Path) -> None:
    trace_dir = pd_scenario().write(tmp_path / "demo")
    out = tmp_path / "out.json"
    r = cli("export", trace_dir, "--to", "chrome", "-o", out)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(out.read_text())
    assert len(by_ph(doc)["X"]) == 25
    assert "25 slices" in r.stdout and "1 flows" in r.stdout


def test_cli_export_default_name(cli, tmp_path: Path, monkeypatch) -> None:
    trace_dir = pd_scenario().write(tmp_path / "demo")
    monkeypatch.chdir(tmp_path)
    r = cli("export", trace_dir, "--request", "r2")
    assert r.exit_code == 0, r.stderr
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert {v for v in names(doc, "thread_name").values() if v.startswith("req ")} == {"req r2"}


@pytest.mark.parametrize("args,message", [
    (["--instance", "nope"], "nothing to show"),
    (["--request", "nope"], "no request nope"),
    (["--since", "9"], "outside the trace"),
])
def test_cli_export_empty_selection_exits_2(cli, tmp_path: Path, args: list[str], message: str) -> None:
    trace_dir = pd_scenario().write(tmp_path / "demo")
    r = cli("export", trace_dir, "-o", tmp_path / "o.json", *args)
    assert r.exit_code == 2
    assert message in r.stderr
    assert not (tmp_path / "o.json").exists()


def test_cli_export_perfetto_when_installed(cli, tmp_path: Path) -> None:
    pytest.importorskip("perfetto.trace_builder.proto_builder")
    trace_dir = pd_scenario().write(tmp_path / "demo")
    r = cli("export", trace_dir, "--to", "perfetto", "-o", tmp_path / "x.pftrace")
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "x.pftrace").stat().st_size > 0
    assert "25 slices" in r.stdout


def test_every_rank_and_scheduler_gets_its_own_thread(tmp_path: Path) -> None:
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="E", start_ns=T0)
    ranks = [(dp, pp, tp) for dp in (0, 1, 10) for pp in (0, 1) for tp in (0, 1)]
    for dp in (0, 1, 10):
        b.add("sched", ts=T0 + dp, step=0, n=1, dp_rank=dp, detail={"dur_ns": 10})
    for i, (dp, pp, tp) in enumerate(ranks):
        kw = {"dp_rank": dp, "pp_rank": pp, "tp_rank": tp, "pid": 2000 + i, "step": 0, "n": 1}
        b.add("exec_begin", ts=T0 + MS, **kw)
        b.add("exec_end", ts=T0 + 2 * MS, **kw)
    doc = chrome(b.trace(), tmp_path)
    threads = names(doc, "thread_name")
    assert len(threads) == len(set(threads.values())) == len(ranks) + 3
    assert {f"dp{dp} PP{pp} TP{tp}" for dp, pp, tp in ranks} | {"scheduler dp0", "scheduler dp1", "scheduler dp10"} \
        == set(threads.values())


@pytest.mark.parametrize("verb", ["plot", "export"])
def test_request_option_is_the_shared_one_in_help(cli, verb: str) -> None:
    """plot and export declare --request once (pdtrace.cli.app.RequestOption): same flags, same help text."""
    from pdtrace.cli.app import RequestOption

    r = cli(verb, "--help")
    assert r.exit_code == 0, r.stderr
    shared = RequestOption.__metadata__[0]
    text = " ".join(r.stdout.split())
    assert "-r, --request" in text
    assert " ".join(shared.help.split()) in text


def test_cli_export_short_request_flag_selects_like_the_long_one(cli, tmp_path: Path) -> None:
    trace_dir = pd_scenario().write(tmp_path / "demo")
    r = cli("export", trace_dir, "-r", "r2", "-o", tmp_path / "short.json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads((tmp_path / "short.json").read_text())
    assert {v for v in names(doc, "thread_name").values() if v.startswith("req ")} == {"req r2"}


def test_chrome_flow_pairs_p_and_d_without_remote_req(tmp_path: Path) -> None:
    """vLLM before 0.28 has no remote_request_id: D's request carries P's id and its req_add names only the
    remote_instance. The send -> receive flow is still drawn, as it is with remote_req."""
    import json as _json

    import pyarrow as pa

    from pdtrace.trace.model import Trace
    from scenarios import healthy_pd

    trace = healthy_pd()
    table = trace.table
    detail = table.column("detail").to_pylist()
    kinds = table.column("kind").cast(pa.string()).to_pylist()
    stripped = []
    for kind, text in zip(kinds, detail):
        d = _json.loads(text) if (kind == "req_add" and text) else None
        if d and d.pop("remote_req", None) is not None:
            text = _json.dumps(d)
        stripped.append(text)
    assert stripped != detail
    bare = Trace(table=table.set_column(table.schema.get_field_index("detail"), "detail",
                                        pa.array(stripped, table.schema.field("detail").type)), path="bare")
    flows = []
    for source in (trace, bare):
        ev = by_ph(chrome(source, tmp_path))
        flows.append((len(ev.get("s", [])), len(ev.get("f", []))))
    assert flows[0] == flows[1] == (1, 1)


def test_a_recorded_wait_is_its_own_slice_nested_in_its_rpc(tmp_path: Path) -> None:
    """Issue 36 item 7: each exec_wait pair is a `wait pp_recv` slice (category wait) on its rank's thread, inside
    that rank's execute_model slice of the same step; without the wait rows there are none."""
    from scenarios_pipeline import pp_recv_pp2

    doc = chrome(pp_recv_pp2("recorded"), tmp_path)
    slices = by_ph(doc)["X"]
    waits = [e for e in slices if e["cat"] == "wait"]
    assert len(waits) == 6 and {e["name"] for e in waits} == {"wait pp_recv"}
    for w in waits:
        rpc = [e for e in slices if e["cat"] == "exec" and e["tid"] == w["tid"]
               and e["name"] == f"step {w['args']['step']} execute_model"]
        assert len(rpc) == 1 and rpc[0]["ts"] <= w["ts"] and w["ts"] + w["dur"] <= rpc[0]["ts"] + rpc[0]["dur"]
        assert w["dur"] == pytest.approx(8000.0)  # µs
    hidden = chrome(pp_recv_pp2("hidden"), tmp_path)
    assert not [e for e in by_ph(hidden)["X"] if e["cat"] == "wait"]


def test_plot_and_export_share_one_declaration_of_the_window_options():
    """`--instance/--since/--until/--request/--memory-check/--window-events` come from `window_options` in both
    verbs: same names, declarations and defaults, and the command gets them gathered."""
    import inspect

    from pdtrace.cli.export import export as export_command
    from pdtrace.cli.plot import plot

    names = ["instance", "since", "until", "request", "memory_check", "window_events"]

    def shared(command):
        params = inspect.signature(command).parameters
        return [(n, params[n].annotation, params[n].default) for n in names]

    assert shared(plot) == shared(export_command)
    assert "shown" not in inspect.signature(plot).parameters

    @window_options
    def probe(trace: str, shown: WindowOptions = WindowOptions()) -> WindowOptions:
        return shown

    got = probe("t", instance=["prefill-0"], since=1.5, until=None, request=None, memory_check=False,
                window_events=0)
    assert got == WindowOptions(instance=("prefill-0",), since=1.5, memory_check=False, window_events=0)
    assert got.window().instances == ("prefill-0",) and got.window().since_s == 1.5

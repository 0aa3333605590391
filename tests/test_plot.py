"""`pdtrace plot`: every kind renders an image of the expected size, and what it draws matches the analyses.

Content is checked through the figure's artists (found by gid), against tables computed by the analyses or, for the
block counts, independently from the events.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from matplotlib.path import Path as MplPath

from pdtrace.analysis.context import AnalysisContext
from pdtrace.plot import KINDS, Window, build_figure, render
from pdtrace.plot.figures import merge_subpixel
from pdtrace.plot.window import EmptySelection
from pdtrace.trace.model import Trace

from scenarios import Engine, builder, healthy_pd, pp4_pipeline  # noqa: E402
from test_timelines import blocks_in_use_by_instance, pd_scenario  # noqa: E402

MS = 1_000_000
SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def bubbly_pipeline() -> Trace:
    """PP=2 with one step in flight at a time and 3 ms of host time between steps: bubbles on both ranks."""
    b = builder()
    e = Engine(b, instance="E", role="both", pp=2, exec_spans=True)
    reqs = [f"q{i}" for i in range(4)]
    for r in reqs:
        e.add(r, n=16)
    for k in range(8):
        alloc = {r: [1 + i] for i, r in enumerate(reqs)} if k == 0 else None
        e.step({r: 16 if k == 0 else 1 for r in reqs}, alloc=alloc)
        e.output()
        b.advance(3 * MS)
    for r in reqs:
        e.finish(r, reason="length")
    return b.trace()


def sample_traces() -> list[Path]:
    """sample_traces/<name>/trace directories (real dry-run traces), when the repository has them."""
    if not SAMPLES.is_dir():
        return []
    return sorted(p / "trace" for p in SAMPLES.iterdir()
                  if (p / "trace").is_dir() and any((p / "trace").rglob("*.parquet")))


@functools.lru_cache(maxsize=1)
def traces() -> list[tuple[str, Trace, AnalysisContext]]:
    """The sample traces when the repository has them, plus the hand-made scenarios; one analysis context each,
    shared by the tests (the analyses are pure, so their cached tables can be)."""
    out: list[tuple[str, Trace]] = []
    if sample_traces():
        from pdtrace.trace.reader import open_trace

        out += [(p.parent.name, open_trace(p, warn=False)) for p in sample_traces()]
    out += [("bubbly_pipeline", bubbly_pipeline()), ("pd_scenario", pd_scenario().trace()),
            ("healthy_pd", healthy_pd()), ("pp4_pipeline", pp4_pipeline())]
    return [(name, trace, AnalysisContext(trace)) for name, trace in out]


def artists(fig, prefix: str) -> list:
    found = []
    for ax in fig.axes:
        found += [a for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]
    return found


def shapes_of(artist) -> int:
    """Shapes a collection draws: one per MOVETO (the figures put many shapes in each compound path)."""
    return sum(1 if p.codes is None else int((p.codes == MplPath.MOVETO).sum()) for p in artist.get_paths())


def n_shapes(fig, prefix: str) -> int:
    return sum(shapes_of(a) for a in artists(fig, prefix))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_renders_an_image_of_the_figure_size(tmp_path: Path, kind: str) -> None:
    rendered = []
    for name, trace, ctx in traces():
        out = tmp_path / f"{name}-{kind}.png"
        try:
            result = render(ctx, kind, out, dpi=50)
        except EmptySelection:
            assert kind == "pipeline" and not trace.events["kind"].astype(str).eq("exec_begin").any()
            continue
        image = imread(out)
        assert image.shape[:2] == (result.height_px, result.width_px)
        assert result.width_px == 14 * 50
        # a real picture: more than a few colours
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 3
        rendered.append(name)
    assert len(rendered) >= len(sample_traces()) + 2


@pytest.mark.parametrize("dpi", [40, 120])
def test_dpi_sets_the_pixel_size(tmp_path: Path, dpi: int) -> None:
    out = tmp_path / "x.png"
    result = render(AnalysisContext(bubbly_pipeline()), "requests", out, dpi=dpi)
    width, height = build_figure(AnalysisContext(bubbly_pipeline()), "requests", dpi=dpi).get_size_inches()
    assert imread(out).shape[:2] == (round(height * dpi), round(width * dpi)) == (result.height_px, result.width_px)


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
def test_vector_formats_by_extension(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"x.{fmt}"
    render(AnalysisContext(bubbly_pipeline()), "pipeline", out)
    head = out.read_bytes()[:200]
    assert (b"<svg" in head or b"<?xml" in head) if fmt == "svg" else head.startswith(b"%PDF")


def drawn_bubbles(ctx: AnalysisContext, lo: int | None = None, hi: int | None = None):
    """The bubbles of the analysis on the lanes the pipeline plot draws (each stage's lowest TP rank), meeting
    [lo, hi]."""
    from pdtrace.analysis.steps import bubbles

    table = bubbles(ctx)
    if len(table) == 0:
        return table
    key = ["instance", "dp_rank", "pp_rank"]
    lowest = table.groupby(key, dropna=False)["tp_rank"].transform("min")
    table = table[table["tp_rank"] == lowest]
    if lo is not None:
        table = table[(table["end_ns"] >= lo) & (table["start_ns"] <= hi)]
    return table


def test_pipeline_shades_one_rectangle_per_bubble_the_analysis_reports() -> None:
    checked = 0
    for name, trace, ctx in traces():
        table = drawn_bubbles(ctx)
        if len(table) == 0:
            continue
        fig = build_figure(ctx, "pipeline", dpi=50)
        assert n_shapes(fig, "bubbles:") == len(table), name
        causes = {a.get_gid().split(":", 1)[1]: shapes_of(a) for a in artists(fig, "bubbles:")}
        assert causes == table["cause"].astype(str).value_counts().to_dict(), name
        # a window: from the start of the bubble a third of the way in to the end of the one two thirds in
        t0 = int(trace.table.column("ts_ns").to_numpy().min())
        ordered = table.sort_values("start_ns")
        first, last = ordered.iloc[len(ordered) // 3], ordered.iloc[2 * len(ordered) // 3]
        since, until = (int(first["start_ns"]) - t0) / 1e9, (int(last["end_ns"]) - t0) / 1e9
        fig = build_figure(ctx, "pipeline", Window(since_s=since, until_s=until), dpi=50)
        lo, hi = t0 + round(since * 1e9), t0 + round(until * 1e9)
        assert n_shapes(fig, "bubbles:") == len(drawn_bubbles(ctx, lo, hi)), name
        checked += 1
    assert checked >= 1

    ctx = AnalysisContext(bubbly_pipeline())
    table = drawn_bubbles(ctx)
    assert len(table) >= 10  # 7 gaps on each of the two ranks
    fig = build_figure(ctx, "pipeline")
    assert n_shapes(fig, "bubbles:") == len(table)
    assert len(fig.axes[0].get_yticks()) == 3  # one lane per PP rank plus the engine lane
    t0 = int(ctx.trace.table.column("ts_ns").to_numpy().min())
    fig = build_figure(ctx, "pipeline", Window(since_s=0.010, until_s=0.020))
    inside = drawn_bubbles(ctx, t0 + 10 * MS, t0 + 20 * MS)
    assert 0 < len(inside) < len(table)
    assert n_shapes(fig, "bubbles:") == len(inside)


def test_pipeline_draws_each_span_and_marks_each_submit_and_output() -> None:
    from pdtrace.analysis.steps import exec_spans

    trace = pp4_pipeline()
    ctx = AnalysisContext(trace)
    fig = build_figure(ctx, "pipeline")
    # spans are wider than a pixel here: one rectangle each
    assert n_shapes(fig, "exec_spans") == len(exec_spans(ctx))
    # four batch-queue slots in the legend (PP=4, four steps in flight)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert sum("batch-queue slot" in x for x in labels) == 4
    # submits and outputs more than a pixel apart: one tick each
    spaced = bubbly_pipeline()
    fig = build_figure(AnalysisContext(spaced), "pipeline")
    kinds = spaced.events["kind"].astype(str)
    assert n_shapes(fig, "step_submit") == int((kinds == "step_submit").sum()) == 8
    assert n_shapes(fig, "step_output") == int((kinds == "step_output").sum()) == 8


def test_spans_narrower_than_a_pixel_are_merged() -> None:
    lane = np.array([0, 0, 0, 0, 1])
    start = np.array([0.0, 10.0, 21.0, 100.0, 5.0])
    end = np.array([9.0, 20.0, 30.0, 110.0, 6.0])
    merged = merge_subpixel(lane, start, end, px_ns=2.0)
    assert merged[["lane", "start", "end", "count"]].values.tolist() == [[0, 0, 30, 3], [0, 100, 110, 1],
                                                                         [1, 5, 6, 1]]
    # a dense pipeline drawn at a low resolution: fewer rectangles than spans, covering the same extent
    from pdtrace.analysis.steps import exec_spans

    ctx = AnalysisContext(pp4_pipeline(n_steps=200))
    fig = build_figure(ctx, "pipeline", dpi=20)
    assert 0 < n_shapes(fig, "exec_spans") < len(exec_spans(ctx))


def test_blocks_plot_peak_equals_an_independent_count_from_the_events() -> None:
    for name, trace, ctx in traces():
        fig = build_figure(ctx, "blocks", dpi=50)
        expected = {inst: max(c for _, c in s) for inst, s in blocks_in_use_by_instance(trace).items()}
        tops = artists(fig, "blocks:leaked")  # the top of each stack: running + finished + leaked = in use
        assert len(tops) == len(expected), name
        peaks = sorted(int(round(max(p.vertices[:, 1].max() for p in a.get_paths()))) for a in tops)
        assert peaks == sorted(expected.values()), name
        pools = artists(fig, "pool")
        assert pools and all(line.get_ydata()[0] > 0 for line in pools)


def test_requests_plot_has_a_lane_per_request_and_marks_findings() -> None:
    from pdtrace.analysis import analyze
    from pdtrace.analysis.timelines import request_phases

    marked = 0
    for name, trace, ctx in traces():
        fig = build_figure(ctx, "requests", dpi=50)
        ph = request_phases(ctx)
        lanes = ph[["instance", "req"]].drop_duplicates()
        assert len(lanes) <= 400, name  # the sample traces are small enough to show every request
        assert n_shapes(fig, "phases:") == len(ph), name
        on_requests = analyze(trace).dropna(subset=["req"])
        on_requests = on_requests[on_requests["ts_ns"].notna()]
        marks = artists(fig, "findings")
        assert sum(len(m.get_offsets()) for m in marks) == len(on_requests), name
        marked += len(on_requests)
    assert marked >= 1  # some trace has findings on requests

    trace = pd_scenario().trace()
    ph = request_phases(AnalysisContext(trace))
    one = build_figure(AnalysisContext(trace), "requests", Window(requests=("d1",)))
    assert len(one.axes[0].get_yticks()) == 1
    assert n_shapes(one, "phases:") == int((ph["req"] == "d1").sum())


def test_steps_plot_draws_every_step_of_each_scheduler() -> None:
    from pdtrace.analysis.steps import step_table

    ctx = AnalysisContext(pd_scenario().trace())
    fig = build_figure(ctx, "steps")
    st = step_table(ctx)
    for inst in ("prefill-0", "decode-0"):
        n = int((st["instance"] == inst).sum())
        assert len(artists(fig, f"steps:dur:{inst}")[0].get_xdata()) == n
        assert len(artists(fig, f"steps:tokens:{inst}")[0].get_ydata()) == n
    tokens = artists(fig, "steps:tokens:prefill-0")[0].get_ydata()
    assert max(tokens) == 70


def test_empty_selections_raise() -> None:
    ctx = AnalysisContext(pd_scenario().trace())
    with pytest.raises(EmptySelection):
        build_figure(ctx, "pipeline", Window(instances=("nope",)))
    with pytest.raises(EmptySelection):
        build_figure(ctx, "requests", Window(requests=("nope",)))
    with pytest.raises(EmptySelection):
        build_figure(ctx, "pipeline", Window(since_s=10.0))
    with pytest.raises(EmptySelection):  # healthy_pd has no exec spans
        build_figure(AnalysisContext(healthy_pd()), "pipeline")


# --- CLI ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return pd_scenario().write(tmp_path / "pdtrace-demo")


def test_cli_plot_writes_the_image(cli, trace_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.png"
    r = cli("plot", trace_dir, "--kind", "pipeline", "-o", out, "--dpi", 50)
    assert r.exit_code == 0, r.stderr
    assert imread(out).shape[:2] == (int(r.stdout.split("(")[1].split("x")[1].split(" ")[0]), 700)
    assert str(out) in r.stdout


def test_cli_plot_default_name_and_window(cli, trace_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = cli("plot", trace_dir, "--kind", "steps", "--since", "0.001", "--until", "0.025", "--instance", "prefill-0")
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "pdtrace-demo-steps.png").is_file()


@pytest.mark.parametrize("args,message", [
    (["--instance", "nope"], "nothing to show"),
    (["--since", "5"], "outside the trace"),
    (["--request", "nope"], "no request nope"),
    (["-o", "x.gif"], "unknown image format"),
    (["--since", "0.02", "--until", "0.01"], "must be after"),
])
def test_cli_plot_bad_selections_exit_2_with_one_line(cli, trace_dir: Path, tmp_path: Path, monkeypatch,
                                                      args: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    r = cli("plot", trace_dir, "--kind", "pipeline", *args)
    assert r.exit_code == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2  # the progress line and the error
    assert not list(tmp_path.glob("*.png"))


def test_requests_plot_caps_lanes_keeping_requests_with_findings() -> None:
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="E", start_ns=1_700_000_000_000_000_000)
    b.add("engine_config", n=4096)
    for i in range(450):  # a short life each; request 437 finishes without freeing its block (a leak)
        req = f"q{i}"
        b.add("req_add", req=req, n=8)
        b.add("blocks_alloc", step=i, req=req, blocks=[i + 1])
        b.add("req_sched", step=i, req=req, n=8)
        if i != 437:
            b.add("blocks_free", step=i, req=req, blocks=[i + 1], reason="finished", deferred=False)
        b.add("req_finish", step=i, req=req, reason="stop", delay_free=False)
    fig = build_figure(AnalysisContext(b.trace()), "requests", dpi=50)
    title = fig.axes[0].get_title()
    assert "400 of 450 requests" in title and "1 with findings" in title
    marks = artists(fig, "findings")
    assert sum(len(m.get_offsets()) for m in marks) >= 1


def test_default_output_names_the_trace_and_kind(tmp_path: Path) -> None:
    from pdtrace.plot import default_output

    (tmp_path / "run7" / "trace").mkdir(parents=True)
    assert default_output(str(tmp_path / "run7" / "trace"), "blocks") == Path("run7-blocks.png")
    assert default_output(str(tmp_path / "run7") + "/", "steps") == Path("run7-steps.png")


def test_request_window_covers_the_request_and_its_peer() -> None:
    from pdtrace.plot.window import resolve

    ctx = AnalysisContext(pd_scenario().trace())
    t0 = int(ctx.trace.table.column("ts_ns").to_numpy().min())
    sel = resolve(ctx, Window(requests=("d1",)))
    assert sel.request_pairs == {("decode-0", "d1"), ("prefill-0", "r1")}
    assert sel.instances == {"decode-0", "prefill-0"}
    assert (sel.lo_ns - t0, sel.hi_ns - t0) == (1 * MS, 25 * MS)  # r1's arrival to d1's free
    # with --instance, only the named request on that instance
    sel = resolve(ctx, Window(requests=("d1",), instances=("decode-0",)))
    assert sel.request_pairs == {("decode-0", "d1")}
    assert (sel.lo_ns - t0, sel.hi_ns - t0) == (8 * MS, 25 * MS)
    with pytest.raises(EmptySelection):
        resolve(ctx, Window(requests=("d1",), instances=("prefill-0",)))


def test_pipeline_lanes_per_dp_rank_and_stage() -> None:
    from pdtrace.trace.builder import EventBuilder

    t0 = 1_700_000_000_000_000_000
    b = EventBuilder(instance="E", start_ns=t0)
    for dp in (0, 1):
        for pp in (0, 1):
            for tp in (0, 1):  # the plot draws each stage from its lowest TP rank
                kw = {"dp_rank": dp, "pp_rank": pp, "tp_rank": tp, "pid": 100 + dp * 10 + pp * 2 + tp, "n": 4}
                for step in range(3):
                    b.add("exec_begin", ts=t0 + step * 5 * MS + pp * MS, step=step, **kw)
                    b.add("exec_end", ts=t0 + step * 5 * MS + (pp + 1) * MS, step=step, **kw)
    fig = build_figure(AnalysisContext(b.trace()), "pipeline")
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["E dp0 engine", "E dp0 PP0", "E dp0 PP1", "E dp1 engine", "E dp1 PP0", "E dp1 PP1"]
    assert n_shapes(fig, "exec_spans") == 2 * 2 * 3  # TP rank 1 is not drawn


def _label_extents(fig) -> list[tuple[str, float, float]]:
    """(text, left x, right x) in display pixels of every y tick label, after a real draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(renderer).x0, t.get_window_extent(renderer).x1)
            for t in fig.axes[0].get_yticklabels() if t.get_text()]


@pytest.mark.parametrize("name", ["1764650000123456789-0f3a9c2e-7b41-4d0e-9a55-3c1e2f7d8b90", "E"])
def test_long_instance_names_are_not_clipped(name: str) -> None:
    """Real instance names (vLLM's engine ids, here a time_ns plus a uuid: 56 characters) are drawn whole,
    inside the figure, on the pipeline and requests plots; a short name keeps the default margin."""
    from pdtrace.trace.builder import EventBuilder

    t0 = 1_700_000_000_000_000_000
    b = EventBuilder(instance=name, start_ns=t0)
    b.add("req_add", ts=t0, req="r1", n=16, pid=1)
    for step in range(3):
        b.add("sched", ts=t0 + step * 5 * MS, step=step, n=16, pid=1)
        b.add("req_sched", ts=t0 + step * 5 * MS, step=step, req="r1", n=16, pid=1)
        for pp in (0, 1):
            kw = {"pp_rank": pp, "tp_rank": 0, "pid": 10 + pp, "n": 16, "component": "worker"}
            b.add("exec_begin", ts=t0 + step * 5 * MS + pp * MS, step=step, **kw)
            b.add("exec_end", ts=t0 + step * 5 * MS + (pp + 1) * MS, step=step, **kw)
    b.add("req_finish", ts=t0 + 16 * MS, step=2, req="r1", reason="length", status="RUNNING", pid=1)
    ctx = AnalysisContext(b.trace())
    for kind in ("pipeline", "requests"):
        fig = build_figure(ctx, kind)
        extents = _label_extents(fig)
        assert extents and all(name in text for text, _, _ in extents), (kind, extents)
        assert all(x0 >= 0 for _, x0, _ in extents), (kind, extents)  # nothing cut at the figure's left edge
        axes_left = fig.axes[0].get_position().x0
        if len(name) == 1:
            assert axes_left == pytest.approx(0.09)
        else:
            assert axes_left > 0.09


def test_pipeline_draws_a_recorded_wait_as_idle_over_its_exec_span() -> None:
    """Issue 36 item 7: stage 1's wait for stage 0 inside execute_model is drawn as idle (a white, hatched
    rectangle per wait over the exec span), one per pp_recv_wait bubble; without the wait rows nothing is."""
    from scenarios_pipeline import pp_recv_pp2

    ctx = AnalysisContext(pp_recv_pp2("recorded"))
    fig = build_figure(ctx, "pipeline", dpi=50)
    waits = artists(fig, "bubbles:pp_recv_wait")
    table = drawn_bubbles(ctx)
    assert len(waits) == 1 and shapes_of(waits[0]) == int((table["cause"] == "pp_recv_wait").sum()) == 6
    assert waits[0].get_hatch() == "////" and tuple(waits[0].get_facecolor()[0]) == (1.0, 1.0, 1.0, 1.0)
    z_exec = [a.get_zorder() for a in artists(fig, "exec_spans")]
    children = fig.axes[0].get_children()
    assert children.index(waits[0]) > max(children.index(a) for a in artists(fig, "exec_spans"))  # drawn over
    assert z_exec and all(z <= waits[0].get_zorder() for z in z_exec)
    hidden = build_figure(AnalysisContext(pp_recv_pp2("hidden")), "pipeline", dpi=50)
    assert artists(hidden, "bubbles:pp_recv_wait") == []

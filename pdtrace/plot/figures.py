"""The figures of `pdtrace plot`, drawn with matplotlib's Agg backend from the analyses' tables.

Every kind draws collections of compound paths (a few paths per colour, 200 shapes each), never one patch or Path
object per span, and merges spans narrower than a pixel into one rectangle, so a figure of a million-event trace
has at most a few thousand shapes per lane. The figures read the analyses' integer tables (codes for instances,
requests and ranks) and name only what they draw. Findings and bubbles come from the rule code `analyze` runs
(`pdtrace.analysis.analyze` and the bubble table of `steps`); nothing here judges the trace. Artists carry a `gid`
("exec_spans", "bubbles:<cause>", "phases:<phase>", "findings", "blocks:<state>", "pool", "steps:dur:<instance>",
...) so tests can find them.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.path import Path  # noqa: E402

from pdtrace.analysis.columns import columns  # noqa: E402
from pdtrace.analysis.context import AnalysisContext  # noqa: E402
from pdtrace.analysis.steps import (BUBBLE_CAUSES, _bubble_frame, _span_frame, gap_frame, instances,  # noqa: E402
                                   step_table)
from pdtrace.analysis.timelines import (BLOCK_STATES, PHASES, _phase_arrays, block_usage,  # noqa: E402
                                       usage_held_at)
from pdtrace.plot.window import Selection, request_findings  # noqa: E402

WIDTH_IN = 14.0
#: Drawing area of the axes as a fraction of the figure width (used to size a pixel in ns).
_AXES_LEFT, _AXES_RIGHT = 0.09, 0.80

SLOT_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
DENSE_COLOR = "#555555"
CAUSE_COLORS = {
    "queue_not_full": "#d62728",
    "scheduler_cpu": "#ff9896",
    "kv_transfer": "#9467bd",
    "stage_imbalance": "#ffbb78",
    "idle_no_requests": "#c7c7c7",
    "sampled_token_wait": "#17becf",
    "pp_recv_wait": "#8c6d31",
    "pp_send_wait": "#843c39",
}
#: Causes recorded inside an RPC (`exec_wait_*`): the exec span is drawn around them, so they are drawn over it as
#: idle (white, hatched in the cause's colour) rather than shaded on top of a busy bar.
HATCHED_CAUSES = ("pp_recv_wait", "pp_send_wait")
PHASE_COLORS = {"waiting": "#fdd49e", "waiting_kv": "#b39ddb", "running": "#41ab5d",
                "finished_holding": "#fd8d3c", "freed": "#eeeeee"}
STATE_COLORS = {"running": "#41ab5d", "finished_awaiting_transfer": "#fd8d3c", "leaked": "#d62728"}
SEVERITY_COLORS = {"error": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
MAX_REQUEST_LANES = 400
MAX_LABELS = 40


@dataclass
class TimeAxis:
    """Maps ns to the x axis: seconds (or ms for short windows) from the trace start."""

    t0_ns: int
    scale_ns: float
    unit: str
    px_ns: float  # how many ns one pixel of the axes spans

    def x(self, ts: np.ndarray | pd.Series | int) -> np.ndarray:
        return (np.asarray(ts, dtype=np.float64) - self.t0_ns) / self.scale_ns

    @property
    def label(self) -> str:
        return f"time since trace start ({self.unit})"


def time_axis(sel: Selection, dpi: float, left: float = _AXES_LEFT) -> TimeAxis:
    span = max(sel.hi_ns - sel.lo_ns, 1)
    scale, unit = (1e6, "ms") if span < 2e9 else (1e9, "s")
    pixels = WIDTH_IN * (_AXES_RIGHT - left) * dpi
    return TimeAxis(sel.t0_ns, scale, unit, span / max(pixels, 1.0))


def _figure(height_in: float, dpi: float, left: float = _AXES_LEFT) -> Figure:
    # Whole inches, so that the image is exactly figsize * dpi pixels for any whole dpi.
    fig = Figure(figsize=(WIDTH_IN, float(max(round(height_in), 3))), dpi=dpi)
    fig.subplots_adjust(left=left, right=_AXES_RIGHT, top=0.92, bottom=0.1)
    return fig


#: The widest left margin the y labels may take (a fraction of the figure width), and the width of one character
#: of the label font in font sizes (DejaVu Sans averages about 0.6 em; digits and hex ids are 0.64).
_MAX_LEFT = 0.4
_CHAR_EM = 0.64


def fit_y_labels(labels: list[str], fontsize: float, extra_in: float = 0.0) -> tuple[list[str], float]:
    """The left margin (figure fraction) that shows the longest y label whole, at least the default and at most
    _MAX_LEFT; labels too long even for that keep their head and tail around an ellipsis. Real instance names
    (vLLM's engine ids, uuids) are 20 to 40 characters and were clipped by the fixed margin. `extra_in`: room
    for a y axis title left of the labels."""
    pad_in = 0.15 + extra_in  # tick marks and the gap between label and axis
    char_in = fontsize * _CHAR_EM / 72.0
    most = int((_MAX_LEFT * WIDTH_IN - pad_in) / char_in)
    fitted = [s if len(s) <= most else s[: (most - 1) // 2] + "\u2026" + s[len(s) - (most - 1 - (most - 1) // 2):]
              for s in labels]
    widest = max((len(s) for s in fitted), default=0)
    return fitted, min(max(_AXES_LEFT, (widest * char_in + pad_in) / WIDTH_IN), _MAX_LEFT)


def _rects(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray) -> np.ndarray:
    """(n, 4, 2) rectangle vertices, built without a Python loop."""
    return np.stack([np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1), np.stack([x1, y0], 1)], 1)


#: Shapes per compound path. Agg snaps a path to whole pixels only while it has at most 1024 vertices, so rectangles
#: (5 vertices) and ticks (2) stay as crisp as one path each.
_SHAPES_PER_PATH = 200
_RECT_CODES = np.array([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY], Path.code_type)
_TICK_CODES = np.array([Path.MOVETO, Path.LINETO], Path.code_type)


def _compound_paths(shapes: np.ndarray, codes: np.ndarray) -> list[Path]:
    """n shapes of k vertices each ((n, k, 2), the same k codes each) as a few compound Paths of at most
    _SHAPES_PER_PATH shapes. Why: a Poly/LineCollection makes one Path object per shape in Python (5-8 us each:
    16 ms for the 2,000 step ticks of a million-event trace); a slice of one vertex array per 200 shapes is free."""
    n, k = shapes.shape[:2]
    flat = shapes.reshape(n * k, 2)
    return [Path(flat[i * k:(i + _SHAPES_PER_PATH) * k], np.tile(codes, min(_SHAPES_PER_PATH, n - i)))
            for i in range(0, n, _SHAPES_PER_PATH)]  # per 200 shapes


def _rect_collection(x0: np.ndarray, x1: np.ndarray, y0: np.ndarray, y1: np.ndarray, colours: np.ndarray | str,
                     **kwargs: object) -> PathCollection:
    """Filled rectangles, one colour each (or one for all), as compound paths grouped by colour."""
    closed = np.concatenate([_rects(x0, x1, y0, y1), np.stack([x0, y0], 1)[:, None, :]], 1)
    if isinstance(colours, str):
        groups = [(colours, np.arange(len(closed)))]
    else:
        names, colour_of = np.unique(np.asarray(colours, dtype=str), return_inverse=True)
        groups = [(str(name), np.flatnonzero(colour_of == i)) for i, name in enumerate(names)]  # per colour (few)
    paths: list[Path] = []
    faces: list[str] = []
    for colour, idx in groups:
        group = _compound_paths(closed[idx], _RECT_CODES)
        paths += group
        faces += [colour] * len(group)
    return PathCollection(paths, facecolors=faces, edgecolors="none", linewidths=0, **kwargs)


def _tick_collection(x: np.ndarray, y0: np.ndarray, y1: np.ndarray, colour: str, **kwargs: object) -> PathCollection:
    """Vertical ticks from y0 to y1 at x, as compound paths."""
    segments = np.stack([np.stack([x, y0], 1), np.stack([x, y1], 1)], 1)
    return PathCollection(_compound_paths(segments, _TICK_CODES), facecolors="none", edgecolors=colour, **kwargs)


def merge_subpixel(lane: np.ndarray, start: np.ndarray, end: np.ndarray, px_ns: float) -> pd.DataFrame:
    """Merge intervals on the same lane that lie within a pixel of each other.

    Sort by (lane, start); a new group starts where an interval begins more than one pixel after the furthest end
    seen so far on its lane (a group-wise cumulative max); each group becomes [min start, max end] with the count
    of intervals it holds and the index of its first one. Returns columns lane, start, end, count, first.
    """
    if len(lane) == 0:
        return pd.DataFrame({"lane": [], "start": [], "end": [], "count": [], "first": []})
    order = np.lexsort((start, lane))
    lane_s, start_s, end_s = lane[order], start[order], end[order]
    reach = pd.Series(end_s).groupby(lane_s).cummax().to_numpy()
    new = np.ones(len(order), dtype=bool)
    new[1:] = (lane_s[1:] != lane_s[:-1]) | (start_s[1:] > reach[:-1] + px_ns)
    bounds = np.flatnonzero(new)
    return pd.DataFrame({
        "lane": lane_s[bounds],
        "start": np.minimum.reduceat(start_s, bounds),
        "end": np.maximum.reduceat(end_s, bounds),
        "count": np.diff(np.append(bounds, len(order))),
        "first": order[bounds],
    })


#: At most this many points of a line are drawn as they are; more are reduced per pixel (`_per_pixel_max`).
FEW_POINTS = 2000


def _per_pixel_max(ts: np.ndarray, value: np.ndarray, px_ns: float, lo_ns: int,
                   few: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel column (from lo_ns), the point of largest value, the first where several are (so peaks survive);
    all points when there are at most `few` (FEW_POINTS where None)."""
    if len(ts) <= (FEW_POINTS if few is None else few):
        return ts, value
    col = ((ts - lo_ns) // max(px_ns, 1.0)).astype(np.int64)
    frame = pd.DataFrame({"col": col, "v": value, "i": np.arange(len(ts))})
    keep = np.sort(frame.loc[frame.groupby("col")["v"].idxmax(), "i"].to_numpy())
    return ts[keep], value[keep]


# --- pipeline -----------------------------------------------------------------------------------------------------


class _Engines:
    """The engines of the pipeline figure, from integer codes: an engine is an instance, or "instance dpN" for an
    instance whose exec spans have several DP ranks. A row's key is instance code * width + dp_rank (a null
    dp_rank counts as 0); names are made once per distinct key (few), and rows reach them through lookup tables,
    so no string is built or compared per row."""

    def __init__(self, names: list[str], spans: tuple[np.ndarray, np.ndarray],
                 *others: tuple[np.ndarray, np.ndarray]) -> None:
        """names: the instance names by code; spans, others: (instance code, dp_rank) of each row of the exec
        spans (which decide the instances with several DP ranks) and of the other rows drawn (bubbles, ticks)."""
        self.names = names
        self.width = max([int(dp.max(initial=0)) for _, dp in (spans, *others)] + [0]) + 1
        n_keys = max(len(names), 1) * self.width
        span_keys = np.flatnonzero(np.bincount(self.key(*spans), minlength=n_keys))
        multi = np.bincount(span_keys // self.width, minlength=len(names)) > 1  # per instance code
        present = span_keys
        for inst, dp in others:  # bubbles, engine rows
            present = np.union1d(present, np.flatnonzero(np.bincount(self.key(inst, dp), minlength=n_keys)))
        labels = [f"{names[k // self.width]} dp{k % self.width}" if multi[k // self.width] else names[k // self.width]
                  for k in present.tolist()]  # per (instance, dp_rank) pair (few)
        self.labels, label_of_present = np.unique(np.asarray(labels, dtype=object), return_inverse=True)
        self.label_of_key = np.full(n_keys, -1, np.int64)
        self.label_of_key[present] = label_of_present

    def key(self, inst: np.ndarray, dp: np.ndarray) -> np.ndarray:
        return inst.astype(np.int64) * self.width + np.maximum(dp, 0)

    def label(self, inst: np.ndarray, dp: np.ndarray) -> np.ndarray:
        """The engine (index into `labels`) of each row."""
        return self.label_of_key[self.key(inst, dp)]


def instance_ranks(ctx: AnalysisContext) -> dict[str, int]:
    """Per instance its place by role: prefill 0, both 1, none 2, decode 3, else 4 (`instance_order`)."""
    cols = columns(ctx)  # the role of each scheduler, from the analyses' scheduler keys: no pass over the trace
    rank = {"prefill": 0, "both": 1, "none": 2, "decode": 3}
    best: dict[str, int] = {}
    for instance, role in zip(cols.sk_names["instance"], cols.sk_role, strict=True):  # per scheduler (few)
        best[str(instance)] = min(best.get(str(instance), 4), rank.get(role, 4))
    return best


def instance_order(ctx: AnalysisContext | dict[str, int], names: list[str],
                   shown: Selection | None = None) -> list[str]:
    """Instances prefill first, then both, then decode (so a P/D pair reads top-down), by name within a role (the
    readable name, `shown`'s, where given); `ctx` may be the ranks (`instance_ranks`) already found."""
    best = ctx if isinstance(ctx, dict) else instance_ranks(ctx)
    return sorted(names, key=lambda n: (best.get(n, 5), shown.shown(n) if shown is not None else n))


def pipeline_figure(ctx: AnalysisContext, sel: Selection, dpi: float) -> Figure:
    """One lane per (instance, DP rank, PP rank): exec spans coloured by batch-queue slot, bubbles shaded by cause,
    step_submit / step_output ticks on an engine lane per scheduler. Drawn from the analyses' integer tables
    (`_span_frame`, `_bubble_frame`, the cached columns): names are made per lane only."""
    cols = columns(ctx)
    names = instances(ctx)
    wanted = np.array([sel.instances is None or n in sel.instances for n in names] + [False], bool)  # per instance

    # exec spans with both ends, of the selected instances: all of them name the lanes; the window clips below
    sf = _span_frame(ctx)
    s_begin, s_end = sf["begin_ts"].to_numpy(), sf["end_ts"].to_numpy()
    s_keep = np.flatnonzero((s_begin >= 0) & (s_end >= 0) & wanted[sf["inst"].to_numpy()])
    s_inst, s_dp, s_pp, s_tp, s_step = (sf[c].to_numpy()[s_keep] for c in ("inst", "dp", "pp", "tp", "step"))
    s_begin, s_end = s_begin[s_keep], s_end[s_keep]
    s_pp, s_tp = np.maximum(s_pp, 0), np.maximum(s_tp, 0)  # a null rank counts as 0
    bub = _bubble_frame(ctx)
    b_start, b_end = bub["start_ns"].to_numpy(np.int64), bub["end_ns"].to_numpy(np.int64)
    b_keep = np.flatnonzero(wanted[bub["inst"].to_numpy()] & sel.overlaps(b_start, b_end))
    in_window = sel.overlaps(s_begin, s_end)
    if not in_window.any() and len(b_keep) == 0:
        raise sel.empty("exec spans (exec_begin/exec_end) or bubbles")
    m_rows = cols.rows_of("step_submit", "step_output")
    inst_codes, _ = cols.codes("instance")
    m_inst, m_dp = inst_codes[m_rows], cols.dp[m_rows].astype(np.int64)
    b_inst, b_dp = bub["inst"].to_numpy()[b_keep], bub["dp"].to_numpy()[b_keep]
    engines_of = _Engines([sel.shown(n) for n in names], (s_inst, s_dp), (b_inst, b_dp),
                          (m_inst[m_inst >= 0], m_dp[m_inst >= 0]))  # labelled by the readable names

    # Lanes: integer keys (engine, pp_rank) throughout; a lookup table maps them to the lane and its TP rank. One
    # lane per stage, drawn from its lowest TP rank (the TP ranks of one stage run in lockstep).
    s_label = engines_of.label(s_inst, s_dp)
    pp_span = int(s_pp.max(initial=0)) + 2
    n_labels = len(engines_of.labels)
    lowest_tp = np.full(n_labels * pp_span, np.iinfo(np.int64).max)
    np.minimum.at(lowest_tp, s_label * pp_span + s_pp, s_tp)
    stage_keys = np.flatnonzero(lowest_tp != np.iinfo(np.int64).max)
    ranks = {sel.shown(inst): rank for inst, rank in instance_ranks(ctx).items()}
    engines = instance_order(ranks, sorted({str(engines_of.labels[k // pp_span]) for k in stage_keys.tolist()}))
    engine_index = {name: i for i, name in enumerate(engines)}
    engine_of_label = np.array([engine_index.get(str(n), -1) for n in engines_of.labels] + [-1], np.int64)
    lane_lut = np.full(len(engines) * pp_span, -1, np.int64)
    tp_lut = np.full(len(engines) * pp_span, -1, np.int64)
    lanes: list[str] = []
    stages = sorted((int(engine_of_label[k // pp_span]), k % pp_span, int(lowest_tp[k])) for k in stage_keys.tolist())
    for i, eng in enumerate(engines):  # per scheduler (few)
        lane_lut[i * pp_span] = len(lanes)  # its engine lane (pp -1)
        lanes.append(f"{eng} engine")
        for _, pp, tp in (stage for stage in stages if stage[0] == i):  # per stage
            lane_lut[i * pp_span + pp + 1] = len(lanes)
            tp_lut[i * pp_span + pp + 1] = tp
            lanes.append(f"{eng} PP{pp}")

    def lane_of(label: np.ndarray, pp: np.ndarray, tp: np.ndarray | None) -> np.ndarray:
        """The lane of each row (-1 where none, or where it is not the stage's drawn TP rank)."""
        glob = engine_of_label[label]
        ok = (glob >= 0) & (pp >= -1) & (pp < pp_span - 1)
        key = np.where(ok, glob * pp_span + pp + 1, 0)
        lane = np.where(ok, lane_lut[key], -1)
        if tp is not None:
            lane = np.where(tp == tp_lut[key], lane, -1)
        return lane

    span_lane = lane_of(s_label, s_pp, s_tp)
    keep = np.flatnonzero(in_window & (span_lane >= 0))
    span_lane, s_label, s_begin, s_end, s_step = (a[keep] for a in (span_lane, s_label, s_begin, s_end, s_step))
    n_lanes = len(lanes)

    lanes, left = fit_y_labels(lanes, 8)
    fig = _figure(min(max(2.0 + 0.7 * n_lanes, 4.0), 14.0), dpi, left)
    ax = fig.add_subplot(1, 1, 1)
    tx = time_axis(sel, dpi, left)
    y_of = (n_lanes - 1 - np.arange(n_lanes)).astype(np.float64)  # first lane on top
    legend: list = []

    # In-flight depth per engine: the most steps step_submit ever saw in flight (1 without a batch queue).
    kind_codes, kind_names = cols.codes("kind")
    m_kind = kind_codes[m_rows]
    m_n = cols.numbers_at("n", m_rows)
    m_label = np.where(m_inst >= 0, engines_of.label(np.maximum(m_inst, 0), m_dp), -1)
    submit_code = kind_names.index("step_submit") if "step_submit" in kind_names else -9
    submits = np.flatnonzero((m_kind == submit_code) & ~np.isnan(m_n) & (m_label >= 0))
    most = np.full(n_labels, -np.inf)
    np.maximum.at(most, m_label[submits], m_n[submits])
    depth_of_label = np.append(np.where(np.isfinite(most), most, 1), 1).astype(np.int64)
    depth = depth_of_label[s_label]
    multi_slot = bool((depth > 1).any())

    # exec spans, merged where several fall within one pixel
    begin = np.maximum(s_begin, sel.lo_ns).astype(np.float64)
    end = np.minimum(s_end, sel.hi_ns).astype(np.float64)
    # Spans at least a pixel wide are drawn one by one; narrower ones are merged where they lie within a pixel of
    # each other (a run of them becomes one dark rectangle).
    narrow = (end - begin) < tx.px_ns
    wide_idx = np.flatnonzero(~narrow)
    narrow_idx = np.flatnonzero(narrow)
    merged = merge_subpixel(span_lane[narrow_idx], begin[narrow_idx], end[narrow_idx], tx.px_ns)
    m_lane = np.concatenate([span_lane[wide_idx], merged["lane"].to_numpy(np.int64)])
    m_start = np.concatenate([begin[wide_idx], merged["start"].to_numpy(np.float64)])
    m_stop = np.concatenate([end[wide_idx], merged["end"].to_numpy(np.float64)])
    single = np.concatenate([np.ones(len(wide_idx), bool), merged["count"].to_numpy() == 1])
    first = np.concatenate([wide_idx, narrow_idx[merged["first"].to_numpy(np.int64)]])
    step = np.maximum(s_step, 0)
    slot = step % np.maximum(depth, 1) if multi_slot else step % 2
    colours = np.where(single, np.array(SLOT_COLORS, dtype=object)[slot[first] % len(SLOT_COLORS)], DENSE_COLOR)
    yc = y_of[m_lane]
    x1 = np.maximum(m_stop, m_start + tx.px_ns)
    ax.add_collection(_rect_collection(tx.x(m_start), tx.x(x1), yc - 0.35, yc + 0.35, colours, gid="exec_spans"))
    for s in sorted(set(slot[first][single].tolist()))[: len(SLOT_COLORS)]:
        name = f"exec, batch-queue slot {s}" if multi_slot else ("exec, even step" if s == 0 else "exec, odd step")
        legend.append(Patch(facecolor=SLOT_COLORS[s % len(SLOT_COLORS)], label=name))
    if not single.all():
        legend.append(Patch(facecolor=DENSE_COLOR, label="exec, several steps per pixel"))

    # bubbles: one shaded rectangle per bubble the analysis reports on a drawn lane
    b_label = engines_of.label(b_inst, b_dp)
    b_lane = lane_of(b_label, np.maximum(bub["pp"].to_numpy()[b_keep], 0), np.maximum(bub["tp"].to_numpy()[b_keep], 0))
    on_lane = b_lane >= 0
    b_lane, b_keep = b_lane[on_lane], b_keep[on_lane]
    b_cause = bub["cause"].cat.codes.to_numpy()[b_keep]
    labels_left = MAX_LABELS
    for cause in sorted(BUBBLE_CAUSES[c] for c in np.unique(b_cause).tolist()):  # per cause (eight)
        part = np.flatnonzero(b_cause == BUBBLE_CAUSES.index(cause))
        b0 = np.maximum(b_start[b_keep[part]], sel.lo_ns)
        b1 = np.minimum(b_end[b_keep[part]], sel.hi_ns)
        yb = y_of[b_lane[part]]
        colour = CAUSE_COLORS.get(cause, "#7f7f7f")
        x1 = tx.x(np.maximum(b1, b0 + 2 * tx.px_ns))  # at least two pixels wide, so that every bubble shows
        if cause in HATCHED_CAUSES:
            hatched = _rect_collection(tx.x(b0), x1, yb - 0.48, yb + 0.48, "white", gid=f"bubbles:{cause}")
            hatched.set_hatch("////")
            hatched.set_edgecolor(colour)
            ax.add_collection(hatched)
            legend.append(Patch(facecolor="white", edgecolor=colour, hatch="////",
                                label=f"idle in exec: {cause} ({len(part)})"))
        else:
            ax.add_collection(_rect_collection(tx.x(b0), x1, yb - 0.48, yb + 0.48, colour, alpha=0.45,
                                               gid=f"bubbles:{cause}"))
            legend.append(Patch(facecolor=colour, alpha=0.45, label=f"bubble: {cause} ({len(part)})"))
        # Label the widest bubbles with their cause where there is room (60 px).
        wide = np.flatnonzero((b1 - b0) >= 60 * tx.px_ns)
        for i in wide[np.argsort(-(b1 - b0)[wide])][:max(labels_left, 0)]:
            ax.text(tx.x((b0[i] + b1[i]) / 2), yb[i], cause.replace("_", " "), ha="center", va="center",
                    fontsize=7, clip_on=True)
        labels_left -= len(wide)

    # step_submit / step_output ticks on each scheduler's engine lane, at most one per pixel column
    m_ts = cols.ts[m_rows]
    mark_lane = np.where(m_label >= 0, lane_of(np.maximum(m_label, 0), np.full(len(m_rows), -1, np.int64), None), -1)
    marked = (mark_lane >= 0) & wanted[np.where(m_inst >= 0, m_inst, len(names))] & sel.contains(m_ts)
    for kind, colour, (lo, hi) in (("step_submit", "#08519c", (0.0, 0.4)), ("step_output", "#a50f15", (-0.4, 0.0))):
        part = np.flatnonzero(marked & (m_kind == (kind_names.index(kind) if kind in kind_names else -9)))
        if len(part) == 0:
            continue
        col = ((m_ts[part] - sel.lo_ns) // max(tx.px_ns, 1.0)).astype(np.int64)
        # the first tick of each (lane, pixel column), in row order
        _, first_tick = np.unique(mark_lane[part] * (int(col.max()) + 1) + col, return_index=True)
        ticks = part[np.sort(first_tick)]
        xs, ys = tx.x(m_ts[ticks]), y_of[mark_lane[ticks]]
        ax.add_collection(_tick_collection(xs, ys + lo, ys + hi, colour, linewidths=0.8, gid=kind))
        legend.append(Line2D([], [], color=colour, label=f"{kind} ({len(part)})"))

    ax.set_yticks(y_of, lanes, fontsize=8)
    ax.set_ylim(-0.6, n_lanes - 0.4)
    ax.set_xlim(tx.x(sel.lo_ns), tx.x(sel.hi_ns))
    ax.set_xlabel(tx.label)
    ax.set_title(f"pipeline: exec spans per PP rank, bubbles by cause ({sel.window.describe()})", fontsize=10)
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return fig


# --- requests -----------------------------------------------------------------------------------------------------


def _request_lanes(ctx: AnalysisContext) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str]]:
    """A lane per request (instance, req), its DP ranks together, from the request keys' integer codes: (lane of
    each request key, instance code and req code of each lane, the instance names, the req names)."""
    cols = columns(ctx)
    inst_of_sk, inst_names = pd.factorize(cols.sk_names["instance"].astype(str), use_na_sentinel=False)
    _, req_names = cols.codes("req")
    width = max(len(req_names), 1)
    pair = inst_of_sk.astype(np.int64)[cols.request_sk] * width + cols.request_req
    pairs, lane_of_key = np.unique(pair, return_inverse=True)
    return lane_of_key, pairs // width, pairs % width, [str(n) for n in inst_names], list(req_names)


def requests_figure(ctx: AnalysisContext, sel: Selection, dpi: float) -> Figure:
    """A swimlane per request through its phases; findings on requests marked where they happen. Drawn from the
    phases' integer keys (`_phase_arrays`); only the drawn lanes (at most MAX_REQUEST_LANES) get names."""
    arrays = _phase_arrays(ctx)
    if arrays is None:
        raise sel.empty("request phases")
    rk, phase_code, start_ns, end_ns = arrays
    pair_of_key, pair_inst, pair_req, inst_names, req_names = _request_lanes(ctx)
    n_pairs = len(pair_inst)
    wanted = np.ones(n_pairs, dtype=bool)
    if sel.instances is not None:
        wanted &= np.isin(pair_inst, [i for i, n in enumerate(inst_names) if n in sel.instances])
    if sel.requests is not None:
        wanted &= np.isin(pair_req, [i for i, n in enumerate(req_names) if n in sel.requests])
    pair = pair_of_key[rk]

    findings = request_findings(ctx)
    f = findings[findings["req"].notna()] if len(findings) else findings
    f_pair = np.empty(0, np.int64)
    if len(f):
        f = f.assign(ts_ns=pd.to_numeric(f["ts_ns"], errors="coerce"))
        f = f[f["ts_ns"].notna()]
        f = f[sel.contains(f["ts_ns"].to_numpy(np.int64))]
        # (instance, req) of each finding to its lane key: a lookup in the sorted lane keys (findings are few)
        inst_index = {n: i for i, n in enumerate(inst_names)}
        req_index = {n: i for i, n in enumerate(req_names)}
        key = np.array([inst_index.get(str(i), -1) * max(len(req_names), 1) + req_index.get(str(r), -10**9)
                        for i, r in zip(f["instance"], f["req"], strict=True)], np.int64)  # per finding
        pair_key = pair_inst * max(len(req_names), 1) + pair_req
        at = np.minimum(np.searchsorted(pair_key, key), max(n_pairs - 1, 0))
        found = (pair_key[at] == key) if n_pairs else np.zeros(len(key), bool)
        f, f_pair = f[found], at[found]
    flagged = np.zeros(n_pairs, dtype=bool)
    flagged[f_pair] = True
    # the window's requests (`Selection.current`), and those a finding in it names
    keep = wanted[pair] & (sel.current(pair, phase_code == PHASES.index("freed"), start_ns, end_ns)
                           | (flagged[pair] & sel.overlaps(start_ns, end_ns)))
    pair, phase_code, start_ns, end_ns = pair[keep], phase_code[keep], start_ns[keep], end_ns[keep]
    if len(pair) == 0:
        raise sel.empty("request phases")

    # Lanes: requests ordered by first phase start; when they are too many, those with findings first.
    present = np.flatnonzero(np.bincount(pair, minlength=n_pairs) > 0)
    first_start = np.full(n_pairs, np.iinfo(np.int64).max)
    np.minimum.at(first_start, pair, start_ns)
    total = len(present)
    sampled = ""
    chosen = present
    if total > MAX_REQUEST_LANES:
        # Too many lanes to read: every request with a finding, then requests evenly spaced in arrival order.
        by_start = present[np.argsort(first_start[present], kind="stable")]
        flagged_rows = by_start[flagged[by_start]][:MAX_REQUEST_LANES]
        rest = by_start[~flagged[by_start]]
        room = MAX_REQUEST_LANES - len(flagged_rows)
        pick = np.unique(np.linspace(0, len(rest) - 1, room).round().astype(np.int64)) if room > 0 and len(rest) \
            else np.empty(0, np.int64)
        chosen = np.concatenate([flagged_rows, rest[pick]])
        sampled = (f"{len(flagged_rows)} with findings, " if len(flagged_rows) else "") + \
            f"{len(pick)} evenly spaced in arrival order"
    first = pd.DataFrame({"pair": chosen, "start_ns": first_start[chosen],
                          "instance": [inst_names[i] for i in pair_inst[chosen].tolist()],  # per drawn lane
                          "req": [req_names[i] for i in pair_req[chosen].tolist()]})
    first = first.sort_values(["start_ns", "instance", "req"]).reset_index(drop=True)
    n_lanes = len(first)
    lane_of_pair = np.full(n_pairs, -1, np.int64)
    lane_of_pair[first["pair"].to_numpy(np.int64)] = np.arange(n_lanes)
    lane = lane_of_pair[pair]
    drawn = lane >= 0
    lane, phase_code, start_ns, end_ns = lane[drawn], phase_code[drawn], start_ns[drawn], end_ns[drawn]
    f_lane = lane_of_pair[f_pair]
    f = f[f_lane >= 0]
    f_lane = f_lane[f_lane >= 0]

    y_labels, left = fit_y_labels([f"{r} ({sel.shown(i)})" for i, r in
                                   zip(first["instance"], first["req"], strict=True)]
                                  if n_lanes <= 40 else [], 7, extra_in=0.25)
    fig = _figure(min(max(1.5 + 0.25 * n_lanes, 4.0), 12.0), dpi, left)
    ax = fig.add_subplot(1, 1, 1)
    tx = time_axis(sel, dpi, left)
    y = (n_lanes - 1 - lane).astype(np.float64)
    legend: list = []
    for code, phase in enumerate(PHASES):
        m = phase_code == code
        if not m.any():
            continue
        s = np.maximum(start_ns[m], sel.lo_ns)
        e = np.minimum(end_ns[m], sel.hi_ns)
        ax.add_collection(_rect_collection(tx.x(s), tx.x(np.maximum(e, s + tx.px_ns)), y[m] - 0.4, y[m] + 0.4,
                                           PHASE_COLORS[phase], gid=f"phases:{phase}"))
        legend.append(Patch(facecolor=PHASE_COLORS[phase], label=phase.replace("_", " ")))

    if len(f):
        fy = (n_lanes - 1 - f_lane).astype(np.float64)
        colours = [SEVERITY_COLORS.get(str(s), "#000000") for s in f["severity"]]
        ax.scatter(tx.x(f["ts_ns"].to_numpy(np.int64)), fy, marker="X", s=40, c=colours, edgecolors="black",
                   linewidths=0.5, zorder=3, gid="findings")
        for sev in ("error", "warning", "info"):
            if (f["severity"] == sev).any():
                legend.append(Line2D([], [], marker="X", linestyle="none", color=SEVERITY_COLORS[sev],
                                     label=f"finding: {sev} ({int((f['severity'] == sev).sum())})"))
        labelled = zip(f["rule"].head(15), f["subrule"].head(15), f["ts_ns"].head(15), fy[:15], strict=True)
        for rule, subrule, ts, yy in labelled:  # a label per finding, the first fifteen
            name = str(rule) + (f"/{subrule}" if isinstance(subrule, str) and subrule else "")
            ax.annotate(name, (float(tx.x(int(ts))), yy), xytext=(4, 4), textcoords="offset points", fontsize=7)

    if n_lanes <= 40:
        ax.set_yticks((n_lanes - 1 - np.arange(n_lanes)).astype(float), y_labels, fontsize=7)
        ax.set_ylabel("request (instance)")
    else:
        ax.set_yticks([])
        ax.set_ylabel(f"requests ({n_lanes}, earliest on top)")
    ax.set_ylim(-0.6, n_lanes - 0.4)
    ax.set_xlim(tx.x(sel.lo_ns), tx.x(sel.hi_ns))
    ax.set_xlabel(tx.label)
    shown = f"{n_lanes} of {total} requests ({sampled})" if total > n_lanes else f"{n_lanes} requests"
    ax.set_title(f"request phases: {shown} ({sel.window.describe()})")
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return fig


# --- blocks -------------------------------------------------------------------------------------------------------


@dataclass
class BlockPanels:
    """What the blocks figure draws: per scheduler (instance, dp_rank) the rows of `block_usage` it draws, reduced
    per pixel, and how many rows they were reduced from; the instances' ranks by role (`instance_ranks`), and every
    scheduler with a block in use, also outside the selection (a panel is named by its DP rank where an instance
    has several)."""

    parts: dict[tuple[str, object], pd.DataFrame]
    rows: dict[tuple[str, object], int]
    ranks: dict[str, int]
    schedulers: set[tuple[str, object]]


def blocks_panels(ctx: AnalysisContext, sel: Selection, tx: TimeAxis, origin_ns: int | None = None,
                  held: bool = True) -> BlockPanels:
    """The blocks figure's rows of one context: per scheduler, its `block_usage` rows in the selection (and, with
    `held`, the last one before it: what was in use at its start), reduced per pixel of `tx` counted from
    `origin_ns` (the selection's start where None). The leaks come from the leaked_blocks rule's own run on this
    context (the code analyze runs; no other rule is needed)."""
    origin = sel.lo_ns if origin_ns is None else origin_ns
    usage = block_usage(ctx)
    usage = usage[sel.keep_instance(usage["instance"])]
    parts: dict[tuple[str, object], pd.DataFrame] = {}
    rows_of: dict[tuple[str, object], int] = {}
    keys = usage[["instance", "dp_rank"]].drop_duplicates()
    schedulers = {(str(inst), None if pd.isna(dp) else dp) for inst, dp in zip(keys["instance"], keys["dp_rank"],
                                                                                strict=True)}
    # each scheduler's rows in the selection, after the one that holds its counts at the selection's start
    shown = sel.contains(usage["ts_ns"].to_numpy(np.int64))
    if held:
        shown |= usage_held_at(usage, sel.lo_ns)
    for inst, dp in zip(keys["instance"], keys["dp_rank"], strict=True):  # one panel per scheduler (few)
        mine = ((usage["instance"] == inst) & ((usage["dp_rank"] == dp) if pd.notna(dp) else usage["dp_rank"].isna())
                ).to_numpy(bool)
        part = usage[mine & shown]
        if len(part) == 0:
            continue
        t = np.maximum(part["ts_ns"].to_numpy(np.int64), sel.lo_ns)
        keep_ts, _ = _per_pixel_max(t, part["in_use"].to_numpy(np.int64), tx.px_ns, origin)
        key = (str(inst), None if pd.isna(dp) else dp)
        parts[key] = part[np.isin(t, keep_ts)] if len(keep_ts) < len(t) else part
        rows_of[key] = len(part)
    return BlockPanels(parts, rows_of, instance_ranks(ctx), schedulers)


def joined_block_panels(pieces: list[BlockPanels], sel: Selection, tx: TimeAxis) -> BlockPanels:
    """One BlockPanels from those of consecutive pieces of the selection (in time order): each scheduler's rows
    joined and reduced per pixel again, as the whole selection's rows would have been (a pixel's point is the
    first of its largest, and each piece kept the first of its own largest)."""
    parts: dict[tuple[str, object], list[pd.DataFrame]] = {}
    rows: dict[tuple[str, object], int] = {}
    ranks: dict[str, int] = {}
    schedulers: set[tuple[str, object]] = set()
    for piece in pieces:
        for key, part in piece.parts.items():
            parts.setdefault(key, []).append(part)
            rows[key] = rows.get(key, 0) + piece.rows[key]
        for name, rank in piece.ranks.items():
            ranks[name] = min(ranks.get(name, rank), rank)
        schedulers |= piece.schedulers
    joined = {}
    for key, frames in parts.items():
        part = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        if rows[key] > FEW_POINTS:  # the whole selection's rows would have been reduced
            t = np.maximum(part["ts_ns"].to_numpy(np.int64), sel.lo_ns)
            keep_ts, _ = _per_pixel_max(t, part["in_use"].to_numpy(np.int64), tx.px_ns, sel.lo_ns, few=0)
            part = part[np.isin(t, keep_ts)]
        joined[key] = part
    return BlockPanels(joined, rows, ranks, schedulers)


def blocks_figure(ctx: AnalysisContext, sel: Selection, dpi: float) -> Figure:
    """KV blocks in use over time per scheduler, stacked by owner state, with the pool size as a line."""
    tx = time_axis(sel, dpi)
    return draw_blocks(blocks_panels(ctx, sel, tx), sel, tx, dpi)


def draw_blocks(panels: BlockPanels, sel: Selection, tx: TimeAxis, dpi: float) -> Figure:
    """The blocks figure of its rows (`blocks_panels`, or `joined_block_panels` of a selection read in pieces)."""
    if not panels.parts:
        raise sel.empty("KV block allocations")
    keys = list(panels.parts)
    order = {name: i for i, name in enumerate(instance_order(panels.ranks, sorted({k[0] for k in keys}), sel))}
    keys.sort(key=lambda k: (order[k[0]], k[1] is None, k[1] if k[1] is not None else 0))
    several_dp = len(panels.schedulers) != len({k[0] for k in panels.schedulers})
    fig = _figure(min(1.0 + 2.6 * len(keys), 14.0), dpi)
    fig.subplots_adjust(top=1 - 0.6 / fig.get_figheight())  # room for the figure's title above the first panel's
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (inst, dp) in zip(axes, keys, strict=True):
        part = panels.parts[(inst, dp)]
        t = np.maximum(part["ts_ns"].to_numpy(np.int64), sel.lo_ns)
        x = np.append(tx.x(t), tx.x(sel.hi_ns))  # hold the last value to the window's end
        base = np.zeros(len(x))
        for state in BLOCK_STATES:
            v = part[state].to_numpy(np.float64)
            top = base + np.append(v, v[-1])
            ax.fill_between(x, base, top, step="post", color=STATE_COLORS[state], linewidth=0,
                            label=state.replace("_", " "), gid=f"blocks:{state}")
            base = top
        pool = part["pool_blocks"].dropna()
        peak = int(part["in_use"].max())
        pool_size = int(pool.iloc[-1]) if len(pool) else None
        # The pool line is on scale unless usage stays under a quarter of it (then the peaks would be flat).
        on_scale = pool_size is not None and peak >= pool_size / 4
        if pool_size is not None:
            ax.axhline(float(pool_size), color="black", linestyle="--", linewidth=1, gid="pool",
                       label=f"pool ({pool_size} blocks)" + ("" if on_scale else ", above the axis"))
        name = sel.shown(inst) if dp is None or not several_dp else f"{sel.shown(inst)} dp{dp}"
        used = f", {100 * peak / pool_size:.1f}% of the pool" if pool_size else ""
        ax.set_title(f"{name}: KV blocks in use (peak {peak}{used})", fontsize=9)
        ax.set_ylabel("blocks")
        ax.set_ylim(0, (max(peak, pool_size) if on_scale else peak) * 1.1 + 1)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.grid(alpha=0.3)
    axes[-1].set_xlim(tx.x(sel.lo_ns), tx.x(sel.hi_ns))
    axes[-1].set_xlabel(tx.label)
    fig.suptitle(f"KV blocks in use by owner state ({sel.window.describe()})")
    return fig


# --- steps --------------------------------------------------------------------------------------------------------


#: The steps figure's lines: (name in a gid, step_table column, divisor to the axis' unit).
STEP_LINES = (("dur", "dur_ns", 1e6), ("tokens", "tokens", 1.0))


@dataclass
class StepLines:
    """What the steps figure draws: per (instance, dp_rank, line of STEP_LINES) the points (sched_ts, value),
    reduced per pixel, and how many points they were reduced from."""

    points: dict[tuple[str, object, str], tuple[np.ndarray, np.ndarray]]
    counts: dict[tuple[str, object, str], int]


def step_lines(ctx: AnalysisContext, sel: Selection, tx: TimeAxis, origin_ns: int | None = None,
               held: bool = True) -> StepLines:
    """The steps figure's points of one context: per scheduler its steps scheduled in the selection, each line's
    values reduced per pixel of `tx` counted from `origin_ns` (the selection's start where None). A step's values
    are its own `sched` row's, so a piece of a window holds them exactly. (`held`: unused, as `blocks_panels`.)"""
    origin = sel.lo_ns if origin_ns is None else origin_ns
    st = step_table(ctx)
    st = st[sel.keep_instance(st["instance"]) & sel.contains(st["sched_ts"].astype("Int64").fillna(-1))]
    points: dict[tuple[str, object, str], tuple[np.ndarray, np.ndarray]] = {}
    counts: dict[tuple[str, object, str], int] = {}
    keys = st[["instance", "dp_rank"]].drop_duplicates()
    for inst, dp in zip(keys["instance"], keys["dp_rank"], strict=True):  # one line per scheduler (few)
        part = st[(st["instance"] == inst) & ((st["dp_rank"] == dp) if pd.notna(dp) else st["dp_rank"].isna())]
        part = part.sort_values("sched_ts", kind="stable")
        t = part["sched_ts"].to_numpy(np.int64)
        for what, column, _ in STEP_LINES:
            v = pd.to_numeric(part[column], errors="coerce").to_numpy(np.float64)
            ok = ~np.isnan(v)
            key = (str(inst), None if pd.isna(dp) else dp, what)
            points[key] = _per_pixel_max(t[ok], v[ok], tx.px_ns, origin)
            counts[key] = int(ok.sum())
    return StepLines(points, counts)


def joined_step_lines(pieces: list[StepLines], sel: Selection, tx: TimeAxis) -> StepLines:
    """One StepLines from those of consecutive pieces of the selection (in time order): each line's points joined
    and reduced per pixel again, as the whole selection's would have been (`joined_block_panels`)."""
    points: dict[tuple[str, object, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    counts: dict[tuple[str, object, str], int] = {}
    for piece in pieces:
        for key, line in piece.points.items():
            points.setdefault(key, []).append(line)
            counts[key] = counts.get(key, 0) + piece.counts[key]
    joined = {}
    for key, lines in points.items():
        t, v = np.concatenate([a for a, _ in lines]), np.concatenate([b for _, b in lines])
        joined[key] = _per_pixel_max(t, v, tx.px_ns, sel.lo_ns, few=0) if counts[key] > FEW_POINTS else (t, v)
    return StepLines(joined, counts)


def steps_figure(ctx: AnalysisContext, sel: Selection, dpi: float) -> Figure:
    """Per scheduler: time inside schedule() per step (ms) and tokens scheduled per step, over time."""
    tx = time_axis(sel, dpi)
    return draw_steps(step_lines(ctx, sel, tx), sel, tx, dpi)


def draw_steps(lines: StepLines, sel: Selection, tx: TimeAxis, dpi: float) -> Figure:
    """The steps figure of its points (`step_lines`, or `joined_step_lines` of a selection read in pieces): the
    schedulers by readable instance name, then DP rank."""
    if not lines.points:
        raise sel.empty("scheduler steps")
    fig = _figure(7.0, dpi)
    ax_dur, ax_tok = fig.subplots(2, 1, sharex=True)
    keys = sorted({key[:2] for key in lines.points}, key=lambda k: (sel.shown(k[0]), k[1] is None, k[1] or 0))
    several_dp = len(keys) != len({inst for inst, _ in keys})
    aggregated = False
    for i, (inst, dp) in enumerate(keys):  # one line per scheduler (few)
        name = sel.shown(inst) if dp is None or not several_dp else f"{sel.shown(inst)} dp{dp}"
        colour = SLOT_COLORS[i % len(SLOT_COLORS)]
        for ax, (what, _, scale) in zip((ax_dur, ax_tok), STEP_LINES, strict=True):
            tt, vv = lines.points[(inst, dp, what)]
            aggregated |= len(tt) < lines.counts[(inst, dp, what)]
            style = dict(marker=".", markersize=3, linewidth=0.8) if len(tt) <= 500 else dict(linewidth=0.6)
            ax.plot(tx.x(tt), vv / scale, color=colour, label=name, gid=f"steps:{what}:{name}", **style)
    ax_dur.set_ylabel("schedule() time (ms)")
    ax_tok.set_ylabel("tokens per step")
    for ax in (ax_dur, ax_tok):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_dur.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
                  title="max per pixel" if aggregated else None)
    ax_tok.set_xlim(tx.x(sel.lo_ns), tx.x(sel.hi_ns))
    ax_tok.set_xlabel(tx.label)
    fig.suptitle(f"scheduler steps: duration and tokens ({sel.window.describe()})")
    return fig


FIGURES = {"pipeline": pipeline_figure, "requests": requests_figure, "blocks": blocks_figure, "steps": steps_figure}

#: The figures drawn from a window read in pieces (`pdtrace.plot.build_figure_in_pieces`): per piece its points
#: (reduced per pixel of the whole window's axis), the pieces' points joined, the figure drawn from them.
PIECES = {"blocks": (blocks_panels, joined_block_panels, draw_blocks),
          "steps": (step_lines, joined_step_lines, draw_steps)}

#: The shared tables each figure reads, built side by side before it draws (pdtrace.analysis.parallel).
FIGURE_TABLES = {"pipeline": (_span_frame, gap_frame), "requests": (_phase_arrays, request_findings),
                 "blocks": (block_usage,), "steps": (step_table,)}

"""Windowed analysis: one instance's long trace analysed in time windows, so memory is bounded by the window.

A partition (`pdtrace.analysis.partitions`) is one instance; a day of one busy instance is ~250M events, far more
than one process holds (~370 bytes per event while the rules run). The state that crosses a moment of the run is
small, though: the requests alive then (at most max_num_seqs plus the queue) with the blocks they own, the steps in
flight, the recorder gaps. So each window is analysed as an ordinary trace that *starts early enough to hold that
state exactly*: the rows from the start of the oldest request or step still open at the cut.

Algorithm:
1. Cheap pass (`plan_windows`, columns only: ts_ns, req, step, dp_rank, kind, read batch by batch, the files on
   the analysis' threads): per request id its first and last ts, the last being the end of the trace where it has
   no req_finish (a request waiting forever is alive at every cut, though it has no row after its admission); per
   (dp_rank, step) its first and last ts; the few rows of the kinds every window reads (`EVERY_WINDOW`:
   engine_config, recorder_gap, recorder_off); the cut times a_1 < a_2 < ... at about every `window_events`-th
   event in time order: weighted quantiles of a sample of about 1M ts (every stride-th of each batch, weighing the
   events it stands for; every ts where the instance has at most 2M), so the plan holds no 8 bytes an event.
   Window k holds the events with a_k <= ts < a_{k+1} (each window counts its own when it reads them). Within a
   batch the first and last ts are taken per dictionary code of req (as Parquet stores it: no string is decoded
   or hashed) and per dense step offset (`_batch_spans`); the batches' few thousand requests each are merged by
   name.
2. Context of window k: the requests and steps *open* at a_k (first < a_k <= last). The window is analysed from
   c_k = the earliest first ts among them, but no more than `lookback` events before a_k (default: half a
   window, so a window's analysis holds at most 1.5 times its events); a request opened earlier still is
   *carried*: its own rows before c_k are added (the rows the rules
   read about it: admission, schedules, allocations). Every window also gets the EVERY_WINDOW rows of the whole
   trace: the configuration, and the gaps that lower a finding anywhere up to the end of the trace.
3. The window's rows [c_k, a_{k+1}) are analysed as an ordinary trace (the rules unchanged) with the whole
   trace's span (`AnalysisContext.span_ns`: "at the end of the trace" means the same in every window). For k > 0
   it is a window starting at c_k (`pdtrace.analysis.history`), so what c_k cut off (a request freed just after
   c_k, a step in flight at c_k) gives no finding.
4. Ownership (`owner`): a finding that names requests (its `req`, its `requests`, the requests of its evidence)
   belongs to the window holding the last row of the latest of them, the first window where each is complete
   and, by 2, whole; one that names none belongs to the window holding its ts. Each window keeps only the findings
   it owns, so none is reported twice, and a window never reports about a request that goes on after it (no
   "still held at the end" for a request that finishes in the next window). Then the windows' findings are
   concatenated per rule (`analyze_windows`).

Exact, and where not (tests/test_windows.py checks the findings equal the whole-trace analysis's on every sample
and scenario at several window sizes; bench/long_trace.py at 10M events):
- Exact when every open request's and step's start lies within the lookback (c_k not clamped): the rules see every
  row of every request they judge and every row of the steps and other requests around it. A carried request (2,
  clamped) has all its own rows but not the steps before c_k: rules that count steps around it (`starved`,
  `zombie` of unscheduled_request) may count fewer; the attrs say how many requests were carried (`carried`).
- A rule that measures over the analysed span declares it (`Rule.per_window`, the reason; of the built-ins
  `pipeline_bubble`: idle fractions), so it is measured per window: each window reports its own (the ranks'
  fractions over [c_k, a_{k+1})), its findings marked `extra.windowed` with that reason.

Cost: the cheap pass reads 5 columns once (60M events: wall 1.2-1.6 s on 2 threads, median 1.44 s, 560 MB peak;
it was 2.0-2.3 s and 960-985 MB holding every ts, and ~10 s with a hash aggregate of the decoded request strings);
each window reads its rows (row groups pruned by their ts statistics, their kept rows sliced rather than copied,
`req` left as Parquet's dictionary codes: `pdtrace.trace.reader`) plus the overlap [c_k, a_k), which on a
serving trace is the life of the longest running request (seconds: a few thousand events). A request that stays
open for longer than the lookback (a request waiting forever) pulls every later window back by the whole
lookback: at most twice the rows, the price of still counting the steps it waits through.

Time windows (`plan_time_windows`, `read_time_window`; `pdtrace plot` and `export` with --since/--until): the same
plan with two given cuts (`TimeCuts`), and what a figure needs besides: a request whose rows leave it holding blocks
is carried into any later window (the plan then reads `blocks`: `_held`), steps open at either edge are read whole
(keyed by their instance too: a P/D pair is planned as one), the read starts a margin before --since and goes on
past --until to the end of what is open there (at most the lookback), and the findings about a request it still
cuts off are left out (`WindowEnd`, `judged`). A long window (the blocks or steps of hours) is cut into pieces of
about --window-events events, each read alone and to its own end (`TimeCuts.split`, `TimeWindow.ends_at`).
"""

from __future__ import annotations

import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from pdtrace.analysis import engine
from pdtrace.analysis.columns import _bits, _values, dictionary_codes
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.findings import empty_findings
from pdtrace.analysis.registry import Rule
from pdtrace.analysis.slices import allocation_settings
from pdtrace.format import SCHEMA
from pdtrace.trace.model import Trace, dictionary_decoded, later_window
from pdtrace.trace.reader import (_DICTIONARY_READ, _filter_expression, column_stats, dataset, describe_unreadable,
                                  open_trace, read_footers, system_memory_pool, unified)

#: Kinds every window reads, whatever its time: configuration, and the recorder's gaps (a gap between a moment and
#: the end of the trace lowers a leak found at that moment).
EVERY_WINDOW = ("engine_config", "recorder_gap", "recorder_off")
#: Default events per window (`AnalysisConfig.window_events`): a window and its lookback fit in ~2 GiB while the
#: rules run.
DEFAULT_WINDOW_EVENTS = 5_000_000
#: With `window_events` left at its default, an instance of at most this many events is analysed whole, as before
#: windows existed (issue 14: one process holds about 15M events; bench/analyze.py's 10M-event trace stays whole).
WHOLE_MAX_EVENTS = 15_000_000


def window_size(config: Any, rows: int) -> int:
    """Events per window for an instance of `rows` events under `config`, 0 to analyse it whole: the one reading of
    `AnalysisConfig.window_events` (negative, the default: DEFAULT_WINDOW_EVENTS above WHOLE_MAX_EVENTS; 0: never;
    N: windows of N for an instance of more than N)."""
    n = int(config.window_events)
    if n < 0:
        return DEFAULT_WINDOW_EVENTS if rows > WHOLE_MAX_EVENTS else 0
    return n if 0 < n < rows else 0
PLAN_COLUMNS = ["ts_ns", "req", "step", "dp_rank", "kind"]
#: Cut times come from a sorted sample of at most this many ts (`plan_windows`).
SAMPLE = 1 << 20
#: The last ts of a request that never finishes: it is open at every cut, and owned by the last window.
OPEN = np.iinfo(np.int64).max


@dataclass
class WindowPlan:
    """The cheap pass's result (module docstring, steps 1-2)."""

    #: cut times: window k holds a[k] <= ts < a[k+1]; a[0] is the first ts, a[-1] one past the last
    cuts: np.ndarray
    #: events per window (time order)
    events: np.ndarray
    #: per window, where its analysed rows start (c_k <= a_k)
    starts: np.ndarray
    #: per window, the requests carried alone (opened before c_k, still open at a_k), and their first ts
    carried: list[dict[str, int]]
    #: per request id: the ts of its last row (OPEN where it never finishes)
    last_ts: dict[str, int]
    #: the EVERY_WINDOW rows' ts (they are read once, in every window)
    every_ts: np.ndarray
    #: per request id, the ts of its last row, also where it never finishes (`plan_windows(row_ends=True)`)
    row_ends: dict[str, int] | None = None

    @property
    def ends(self) -> dict[str, int]:
        """Per request id, the ts of its last row: `row_ends` where the plan found them, else `last_ts`."""
        return self.row_ends if self.row_ends is not None else self.last_ts

    def __len__(self) -> int:
        return len(self.events)

    def window_of(self, ts: np.ndarray | int) -> np.ndarray | int:
        """The window holding ts (clamped to the first and last)."""
        k = np.searchsorted(self.cuts, ts, side="right") - 1
        return np.clip(k, 0, len(self.events) - 1)


@dataclass
class WindowInfo:
    """One analysed window, for progress callbacks (`progress(info, info)`, like a partition's task and result)."""

    instance: str
    index: int
    total: int
    events: int
    #: rows the window's analysis read (its events, the lookback before its cut, the carried rows)
    analysed: int = 0
    seconds: float = 0.0
    summaries: bool = False

    @property
    def name(self) -> str:
        return f"{self.instance} window {self.index + 1}/{self.total}"


LO, HI = np.iinfo(np.int64).max, np.iinfo(np.int64).min
NO_STEP = HI  # the key of a row without a step (`_step_spans`): no (dp_rank, step) has it


class BatchPart(NamedTuple):
    """One batch's part of the plan (`_group_parts`)."""

    #: per request seen: (names, first ts, last ts, finished)
    reqs: tuple[Any, ...]
    #: per step key (step + (dp_rank + 1) << 40): (keys, first ts, last ts)
    steps: tuple[np.ndarray, ...]
    #: the EVERY_WINDOW rows' ts
    every_ts: np.ndarray
    least: int
    greatest: int
    #: every stride-th ts, each standing for rows / len(sample) events
    sample: np.ndarray
    rows: int


def _first_last(codes: np.ndarray, ts: np.ndarray, m: int,
                last_ts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per code in [0, m): the least ts and the greatest (of `last_ts` where given; LO > HI where the code has no
    row)."""
    first, last = np.full(m, LO, np.int64), np.full(m, HI, np.int64)
    np.minimum.at(first, codes, ts)
    np.maximum.at(last, codes, ts if last_ts is None else last_ts)
    return first, last


def _kind_rows(column: pa.Array, *groups: Sequence[str]) -> list[np.ndarray]:
    """Per group of kinds, the rows of the kind column with one of them, as row numbers: a comparison of the
    indices with the few dictionary codes of those kinds, the kinds never decoded (the plan's batches of 20M
    events: CPU 0.02 s against 0.06 s for a gather of a class per row through the dictionary; one core)."""
    values, names = dictionary_codes(pa.chunked_array([column]))

    def rows(codes: list[int]) -> np.ndarray:
        if not codes:
            return np.empty(0, np.intp)
        mask = values == codes[0]
        for code in codes[1:]:
            mask |= values == code
        return np.flatnonzero(mask)

    return [rows([i for i, v in enumerate(names) if v in group]) for group in groups]


#: Kinds whose `blocks` a request takes, and gives up (`_held`). Not req_wait_kv: its blocks are also the
#: blocks_alloc of the same `allocate_slots` call (its table's growth).
TAKES, GIVES = ("blocks_alloc",), ("blocks_free",)


def _held(batch: pa.RecordBatch, codes: np.ndarray, m: int) -> np.ndarray | None:
    """Per request code, the blocks its rows of the batch take less those they give up (TAKES, GIVES); None
    without a `blocks` column (the windowed analysis' plan does not read it)."""
    if "blocks" not in batch.schema.names:
        return None
    takes, gives = _kind_rows(batch.column("kind"), TAKES, GIVES)
    length = pc.fill_null(pc.list_value_length(batch.column("blocks")), 0).to_numpy().astype(np.int64)

    def per_code(rows: np.ndarray) -> np.ndarray:
        # bincount with weights gives float64, but int64 where there are no rows: one dtype either way
        return np.bincount(codes[rows], weights=length[rows], minlength=m).astype(np.int64)

    return per_code(takes) - per_code(gives)


def _batch_spans(batch: pa.RecordBatch) -> tuple[Any, ...]:
    """One batch's part of the plan: per request (names, first, last, finished), per step key (keys, first, last),
    the EVERY_WINDOW rows' ts, the batch's least and greatest ts. First and last by `np.minimum.at` /
    `np.maximum.at` over the requests' dictionary codes, and per run of equal step keys (`_step_spans`), rather
    than a hash aggregate of the request strings and step keys (the batches of 20M events: 1.5 s against 3.8 s,
    and the strings are not decoded; the plan 2.8 s against 5.8 s; with `_step_spans` and `_kind_rows`, CPU 0.24 s
    against 0.38 s, one core)."""
    ts = batch.column("ts_ns").to_numpy()
    finish_rows, every_rows = _kind_rows(batch.column("kind"), ("req_finish",), EVERY_WINDOW)
    # requests: the dictionary's codes (the files' own dictionary; a plain column is encoded here)
    req = batch.column("req")
    req = req if pa.types.is_dictionary(req.type) else pc.dictionary_encode(req)
    m = len(req.dictionary)
    codes = (pc.fill_null(req.indices, m) if req.null_count else req.indices).to_numpy()  # null: code m, dropped
    first, last = _first_last(codes, ts, m + 1)  # every row has a code (null: m), so these bound the batch too
    finished = np.zeros(m + 1, bool)
    finished[codes[finish_rows]] = True
    seen = np.flatnonzero(first[:m] <= last[:m])
    held = _held(batch, codes, m + 1)
    reqs = (req.dictionary.take(pa.array(seen)).cast(pa.string()), first[seen], last[seen], finished[seen],
            None if held is None else held[seen])
    # steps: one int64 key per (dp_rank, step) (step + (dp_rank + 1) << 40), a null step dropped
    steps = _step_spans(batch.column("step"), batch.column("dp_rank"), ts,
                        batch.column("instance") if "instance" in batch.schema.names else None)
    return reqs, steps, ts[every_rows], int(first.min()), int(last.max())


def _instance_tags(instance: pa.Array) -> np.ndarray:
    """Per row, a 16-bit tag of its instance's name (crc32; a null instance: 0): the same in every batch, unlike
    dictionary codes. Two instances whose tags collide share their step keys: their steps' spans are merged (a
    read goes back further, never less far)."""
    codes, names = dictionary_codes(pa.chunked_array([instance]))
    tags = np.array([zlib.crc32(str(name).encode()) & 0xFFFF for name in names] + [0], np.int64)
    return tags[codes]  # a null (-1): the last tag, 0


def _step_spans(step: pa.Array, rank: pa.Array, ts: np.ndarray,
                instance: pa.Array | None = None) -> tuple[np.ndarray, ...]:
    """(keys, first, last) of a batch's steps, key step + (dp_rank + 1) << 40 (a null dp_rank: -1), rows without a
    step left out. A step's rows come in runs (a scheduler step's req_sched rows one after another), so the first
    and last ts are reduced per run of equal keys (`np.minimum.reduceat`: two passes that stream), then per key over
    the runs; the values are read from the Arrow buffers (no fill_null, min_max or casts). The plan's batches of
    20M events: CPU 0.12 s against 0.19 s for `np.minimum.at` over dense offsets of every row (one core)."""
    if step.null_count == len(step):
        return (np.empty(0, np.int64),) * 3
    key = _values(rank, np.int64, -1)
    if not key.flags.writeable:  # an int64 column without nulls: a view of the Arrow buffer
        key = key.copy()
    key += 1
    if instance is not None:  # the steps of each instance apart: a P/D pair's step numbers are not one sequence
        key += _instance_tags(instance) << 7
    key <<= 40
    key += _values(step, np.int64, 0)
    if step.null_count:
        key[~_bits(step.buffers()[0], step.offset, len(step))] = NO_STEP
    starts = np.flatnonzero(key[1:] != key[:-1])
    starts += 1
    starts = np.r_[0, starts]
    run_key = key[starts]
    first, last = np.minimum.reduceat(ts, starts), np.maximum.reduceat(ts, starts)
    keep = run_key != NO_STEP
    return _key_spans(run_key[keep], first[keep], last[keep])  # the runs: a few per step


def _key_spans(keys: np.ndarray, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, ...]:
    """(distinct keys ascending, least first, greatest last) of step keys (step + (dp_rank + 1) << 40). A
    dp_rank's steps are consecutive integers, so each dp_rank's keys are reduced over the dense range between its
    least and greatest (`np.minimum.at` on offsets) where that range is at most 4 times the keys (plus 64K), and
    by a sort (`np.unique`) otherwise. 60M events (bench/long_trace.py, 2.3M keys from 279 batches): the plan's
    serial merge of its batches' steps 0.39-0.44 s with `np.unique` alone, 0.03 s this way (where its memory is
    not faulted in afresh); the plan alone, 5 interleaved pairs, median wall 1.63 s against 1.44 s."""
    if len(keys) == 0:
        return (np.empty(0, np.int64),) * 3
    rank = keys >> 40
    lo, hi = int(rank.min()), int(rank.max())
    parts = []
    for r in range(lo, hi + 1) if hi - lo < 64 else np.unique(rank).tolist():  # dp_ranks: few
        mask = None if lo == hi else rank == r
        k, f, l = (keys, first, last) if mask is None else (keys[mask], first[mask], last[mask])
        if len(k) == 0:
            continue
        base, top = int(k.min()), int(k.max())
        if top - base <= 4 * len(k) + (1 << 16):
            offset = k - base
            span_first, span_last = _first_last(offset, f, top - base + 1, l)
            seen = np.flatnonzero(span_first <= span_last)
            parts.append((seen + base, span_first[seen], span_last[seen]))
        else:
            distinct, at = np.unique(k, return_inverse=True)
            parts.append((distinct,) + _first_last(at, f, len(distinct), l))
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def _group_parts(group: Any, stride: int) -> list[BatchPart]:
    """One group's part of the plan (`plan_windows`): per batch `_batch_spans` plus the batch's ts sample (every
    `stride`-th) and its row count. A group is a batch, a table or a callable returning an iterable of them (a
    file's batches, read where it is called: on a plan thread)."""
    out = []
    try:
        for part in group() if callable(group) else [group]:
            for batch in part.to_batches() if isinstance(part, pa.Table) else [part]:
                if batch.num_rows == 0:
                    continue
                ts = batch.column("ts_ns").to_numpy()
                # the sample is copied: the batch's buffers go with the batch (the plan holds no 8 bytes an event)
                out.append(BatchPart(*_batch_spans(batch), ts[::stride].copy(), len(ts)))
    except (OSError, pa.ArrowException) as exc:
        if not isinstance(group, PlanFile):
            raise
        group.unreadable(exc)  # the whole file is left out, as open_trace leaves a corrupt file out
        return []
    return out


class PlanFile:
    """One file's PLAN_COLUMNS for the plan, in batches read where it is called (on a plan thread); a file whose
    data cannot be decoded (a corrupt page under an intact footer) goes to `skip` with the reason."""

    def __init__(self, name: str, read: Callable[[str], Any], skip: Callable[[str, BaseException], None]) -> None:
        self.name, self.read, self.skip = name, read, skip

    def __call__(self) -> Any:
        return self.read(self.name)

    def unreadable(self, exc: BaseException) -> None:
        self.skip(self.name, exc)


def _weighted_quantiles(sample: np.ndarray, weight: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per count c: the least sampled ts with more than c events (by the samples' weights) at or before it."""
    below = np.cumsum(weight)
    return sample[np.minimum(np.searchsorted(below, counts, side="right"), len(sample) - 1)]


@dataclass(frozen=True)
class TimeCuts:
    """Cuts at given times (a plot's or an export's window: `plan_time_windows`) for `plan_windows`, instead of
    one every `window_events` events."""

    #: the cut times; those outside the rows' time range are left out
    at: Sequence[int]
    #: (least, most) events: a window starts about `least` events before its cut at least (a plot's read holds the
    #: idle gap that straddles its start), and with `ahead` one more cut follows the last, at the end of the
    #: requests and steps open at it (a read up to it holds them whole), but `least` events after it at least and
    #: `most` at most
    margin: tuple[int, int] | None = None
    ahead: bool = False
    #: a step open at a cut takes the window's start back to its first row, and one open at the last cut the
    #: read-ahead on to its last row, whatever the lookback (a plot draws the steps in flight at its edges whole; a
    #: step hung for longer than the lookback most of all)
    whole_steps: bool = False
    #: the stretch from the first cut to the last is also cut every `split` events (a long window read in pieces)
    split: int = 0


class _PlanInput(NamedTuple):
    """What the plan's pass over the rows found (`_plan_input`)."""

    events: int
    names: np.ndarray
    #: per request: its first row's ts, its last (OPEN where it never finishes), its last row's, whether its rows
    #: leave it holding blocks
    r_first: np.ndarray
    r_last: np.ndarray
    r_row_last: np.ndarray
    holding: np.ndarray
    #: per step key: its first and last row's ts
    s_first: np.ndarray
    s_last: np.ndarray
    every_ts: np.ndarray
    #: the ts sample, sorted, and the events each sampled ts stands for
    sample: np.ndarray
    weight: np.ndarray
    first: int
    last: int


def _plan_input(groups: list[Any], rows: int | None, jobs: int) -> _PlanInput | None:
    """The plan's pass over `groups` (`plan_windows`); None where they hold no rows."""
    if rows is None and all(isinstance(g, (pa.Table, pa.RecordBatch)) for g in groups):
        rows = sum(g.num_rows for g in groups)
    stride = max(1, int(rows or 0) // SAMPLE)
    if jobs > 1 and len(groups) > 1:
        # the files' decoding releases the GIL, and so do the numpy passes over a batch: 60M events (bench/
        # long_trace.py) wall 1.05-1.6 s on 2 threads against 1.4-1.6 s on one
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="pdtrace-plan") as pool:
            parts = [p for done in pool.map(lambda g: _group_parts(g, stride), groups) for p in done]
    else:
        parts = [p for g in groups for p in _group_parts(g, stride)]
    n = sum(p.rows for p in parts)
    if n == 0:
        return None
    names, r_first, r_last, finished, held = _merged_requests([p.reqs for p in parts])
    # a request whose last row leaves it holding blocks (where the plan read them): it holds them from then on
    holding = held > 0 if held is not None else np.zeros(len(r_last), bool)
    s_first, s_last = _merged_steps([p.steps for p in parts])
    every_ts = np.unique(np.concatenate([p.every_ts for p in parts]))
    # the cut times are quantiles of the ts sample, each sampled ts weighing the events of its batch it stands
    # for (exact where every ts is sampled: stride 1); one sort of at most ~SAMPLE values replaces a selection
    # pass per cut. Each batch's sample is a sorted run (a row group in time order): the stable sort merges them.
    sample = np.concatenate([p.sample for p in parts])
    weight = np.concatenate([np.full(len(p.sample), p.rows / len(p.sample)) for p in parts])
    order = np.argsort(sample, kind="stable")
    return _PlanInput(n, names, r_first, np.where(finished, r_last, OPEN), r_last, holding, s_first, s_last,
                      every_ts, sample[order], weight[order], min(p.least for p in parts),
                      max(p.greatest for p in parts))


def _cuts_at(plan: _PlanInput, times: TimeCuts) -> tuple[np.ndarray, np.ndarray]:
    """(cut times, events before each) of `times` (`TimeCuts`): its cuts, those every `split` events between the
    first and the last, and with `ahead` the end of the read past the last."""
    sample, weight = plan.sample, plan.weight
    mark_ts = np.asarray(sorted(int(c) for c in times.at), np.int64)
    below_of = np.r_[0.0, np.cumsum(weight)]
    targets = below_of[np.searchsorted(sample, mark_ts, side="left")]
    split = times.split
    if split > 0 and len(mark_ts) > 1:  # more cuts between the first and the last (`ahead` follows the last)
        inner = _weighted_quantiles(sample, weight, np.arange(targets[0] + split, targets[-1] - split / 4, split))
        inner = inner[(inner > mark_ts[0]) & (inner < mark_ts[-1])]
        mark_ts = np.unique(np.r_[mark_ts, inner]).astype(np.int64)
        targets = below_of[np.searchsorted(sample, mark_ts, side="left")]
    if times.ahead and times.margin is not None and len(targets):
        a = int(mark_ts[-1])
        least, most = _weighted_quantiles(sample, weight, targets[-1] + np.asarray(times.margin, np.float64))
        # the last rows of those open at a (a request that never finishes: its last row, not OPEN); a step's whole
        # with `whole_steps`, as at a window's start
        r_open = (plan.r_first < a) & (plan.r_last >= a)
        r_end = int(plan.r_row_last[r_open].max(initial=a)) + 1
        s_end = int(plan.s_last[(plan.s_first < a) & (plan.s_last >= a)].max(initial=a)) + 1
        mark_ts = np.r_[mark_ts, max(a + 1, int(least), min(r_end, int(most)),
                                     s_end if times.whole_steps else min(s_end, int(most)))]
        targets = np.r_[targets, targets[-1]]  # its lookback bound is not used (no window starts there)
    return mark_ts, targets


def plan_windows(groups: Iterable[Any], window_events: int, lookback: int | None = None, *,
                 rows: int | None = None, jobs: int = 1, times: TimeCuts | None = None,
                 row_ends: bool = False) -> WindowPlan:
    """The windows of one instance's rows (module docstring, steps 1-2). `groups`: record batches or tables of
    PLAN_COLUMNS, or callables returning an iterable of them (one file's batches each), read on `jobs` threads.
    `rows`: at most how many rows they hold, which sets the ts sample's stride (None: the rows of the tables given,
    else every ts is sampled). `lookback`: the most events a window's analysis starts before its cut (None: half a
    window). `times`: cuts at given times (`TimeCuts`, a plot's window), instead of one every `window_events`
    events. `row_ends`: also `WindowPlan.row_ends`."""
    lookback = max(window_events // 2, 1) if lookback is None else int(lookback)
    plan = _plan_input(list(groups), rows, jobs)
    if plan is None:
        return WindowPlan(np.array([0, 1], np.int64), np.array([0]), np.array([0], np.int64), [{}], {},
                          np.empty(0, np.int64))
    n, sample, weight, first, last = plan.events, plan.sample, plan.weight, plan.first, plan.last
    if times is None:
        count = max(1, -(-n // max(int(window_events), 1)))
        targets = np.array([k * n // count for k in range(1, count)], np.float64)
        mark_ts = _weighted_quantiles(sample, weight, targets)
    else:  # the events before each given cut, by the sample's weights
        mark_ts, targets = _cuts_at(plan, times)
    margin = times.margin if times is not None else None
    behind_ts = _weighted_quantiles(sample, weight, np.maximum(targets - lookback, 0))
    least_ts = _weighted_quantiles(sample, weight, np.maximum(targets - (margin[0] if margin else 0), 0))
    values, at = np.unique(mark_ts, return_index=True)  # equal ts never straddle a cut
    keep = (values > first) & (values <= last)
    cuts = np.r_[first, values[keep], last + 1].astype(np.int64)
    bounds = np.r_[first, behind_ts[at][keep]].astype(np.int64)
    margins = np.r_[first, least_ts[at][keep]].astype(np.int64) if margin else cuts[:-1]
    # events per window, by the sample's weights (exact with stride 1; `analyze_windows` counts them exactly in
    # each window's rows)
    below = np.r_[0.0, np.cumsum(weight)][np.searchsorted(sample, cuts, side="left")]
    below = np.rint(below).astype(np.int64)
    below[0], below[-1] = 0, n
    events = np.diff(below)
    names, r_first, r_last, s_first, s_last = plan.names, plan.r_first, plan.r_last, plan.s_first, plan.s_last
    whole_steps = times is not None and times.whole_steps
    starts = [first]
    carried: list[dict[str, int]] = [{}]
    for k in range(1, len(cuts) - 1):  # per window: few
        a, bound = int(cuts[k]), int(bounds[k])
        r_open = (r_first < a) & (r_last >= a)
        s_open = (s_first < a) & (s_last >= a)
        # back to the oldest open request or step, at most to the lookback bound: an older request is carried,
        # and the rules still see a lookback's worth of the steps it waited through (unscheduled_request counts
        # them; with fewer it would stay silent rather than report, marked, what it saw)
        oldest_step = [int(s_first[s_open].min())] if s_open.any() else []
        start = min([a] + ([int(r_first[r_open].min())] if r_open.any() else []) + oldest_step)
        start = max(start, bound)
        if whole_steps:
            start = min([start] + oldest_step)
        start = min(start, int(margins[k]))
        starts.append(start)
        early = (r_open & (r_first < start)) | (plan.holding & (r_last < start))
        carried.append(dict(zip(names[early].tolist(), r_first[early].tolist())))
    return WindowPlan(cuts, np.asarray(events, np.int64), np.asarray(starts, np.int64), carried,
                      dict(zip(names.tolist(), r_last.tolist())), plan.every_ts,
                      dict(zip(names.tolist(), plan.r_row_last.tolist())) if row_ends else None)


def _merged_requests(parts: list[tuple[Any, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                              np.ndarray | None]:
    """(names, first, last, finished, held) per request from the batches' (`_batch_spans`): the earliest first,
    the latest last, any finish, the blocks held after its last row (the sum of `_held`; None where the batches
    have no blocks). The names are encoded once and merged by code (a hash aggregate of the names by Arrow cost 2-4
    times as much: 0.3-0.5 s against 0.14 s with the steps' merge, at 20M events)."""
    if not parts or not sum(len(p[1]) for p in parts):
        empty = np.empty(0, np.int64)
        return np.empty(0, object), empty, empty, np.empty(0, bool), None
    encoded = pc.dictionary_encode(pa.concat_arrays([p[0] for p in parts]))
    codes, m = encoded.indices.to_numpy(), len(encoded.dictionary)
    first, last = _first_last(codes, np.concatenate([p[1] for p in parts]), m, np.concatenate([p[2] for p in parts]))
    finished = np.zeros(m, bool)
    finished[codes[np.concatenate([p[3] for p in parts])]] = True
    held = None
    if all(p[4] is not None for p in parts):
        held = np.bincount(codes, weights=np.concatenate([p[4] for p in parts]), minlength=m).astype(np.int64)
    return encoded.dictionary.to_numpy(zero_copy_only=False).astype(object), first, last, finished, held


def _merged_steps(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) per step key from the batches' (`_batch_spans`): the earliest first, the latest last."""
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    _, first, last = _key_spans(*(np.concatenate([p[i] for p in parts]) for i in range(3)))
    return first, last


def in_time(ts: pa.ChunkedArray, start: int, end: int) -> pa.ChunkedArray:
    """The mask start <= ts < end of a ts_ns column."""
    return pc.and_(pc.greater_equal(ts, pa.scalar(start, pa.int64())), pc.less(ts, pa.scalar(end, pa.int64())))


def window_rows(table: pa.Table, start: int, end: int, carried: dict[str, int]) -> pa.ChunkedArray:
    """The mask of the rows window analyses (module docstring, step 2): start <= ts < end, the EVERY_WINDOW rows,
    and the carried requests' rows before start."""
    ts = table.column("ts_ns")
    mask = in_time(ts, start, end)
    mask = pc.or_(mask, pc.is_in(dictionary_decoded(table.column("kind")), value_set=pa.array(EVERY_WINDOW)))
    if carried:
        early = pc.and_(pc.less(ts, pa.scalar(start, pa.int64())),
                        pc.is_in(dictionary_decoded(table.column("req")),
                                 value_set=pa.array(list(carried), pa.string())))
        mask = pc.or_(mask, pc.fill_null(early, False))
    return mask


class MemorySource:
    """The windows' rows from a loaded trace (one instance's rows)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def plan_groups(self, columns: Sequence[str] = PLAN_COLUMNS) -> list[pa.Table]:
        """The plan's input (`plan_windows`): the loaded rows' `columns`."""
        return [self.trace.table.select(list(columns))]

    @property
    def plan_rows(self) -> int:
        return len(self.trace)

    @property
    def warnings(self) -> list[str]:
        return []  # the loaded trace's own are the windows'

    def rows(self, start: int, end: int, plan: WindowPlan, k: int) -> Trace:
        out = self.trace.filter(window_rows(self.trace.table, start, end, plan.carried[k]))
        out.__dict__.pop("events", None)
        return out


#: At most this many EVERY_WINDOW rows are fetched by their exact ts (row groups pruned by statistics); more are
#: fetched by a filter on the kind (every row group read).
EXACT_FETCH = 256


class PathSource:
    """The windows' rows read from a trace directory (one partition's files): the window's ts range (row groups
    pruned by their ts statistics), then the EVERY_WINDOW and carried rows outside it."""

    def __init__(self, path: str, instances: Sequence[str] | None, files: Sequence[str] | None,
                 config: AnalysisConfig) -> None:
        self.path, self.instances, self.config = path, instances, config
        footers = read_footers(path, files)
        self.files = [f.path for f in footers.files]
        #: the files' rows by their footers: at least the instance's (`plan_windows` sizes its ts sample by it)
        self.plan_rows = sum(f.rows for f in footers.files)
        #: per file, (first, last) ts_ns from its footer's statistics; None: unknown (always read)
        self.spans: list[tuple[int, int] | None] = []
        for name in self.files:
            stats = column_stats(footers.metadata[name], "ts_ns")
            self.spans.append((int(min(lo for lo, _ in stats)), int(max(hi for _, hi in stats)))
                              if stats else None)
        self._every: pa.Table | None = None  # `rows`: the EVERY_WINDOW rows, read once
        #: `_extra`: the rows of carried requests whose last row came before the window that read them (a leak),
        #: and their names: a later window that carries them again takes them from here
        self._ended_rows: list[pa.Table] = []
        self._ended: set[str] = set()
        #: files whose data the plan could not decode (a corrupt page under an intact footer), with why: skipped
        #: by every window, as the whole-trace read skips them (`warnings`). A corrupt page in a column the plan
        #: does not read is skipped by the windows that read it (`open_trace`'s own fallback), after the plan
        #: counted the file's rows.
        self.corrupt: dict[str, str] = {}

    @property
    def warnings(self) -> list[str]:
        """The plan's skipped files, worded as `open_trace` words them."""
        return [f"{name}: skipped: {why}" for name, why in self.corrupt.items()]

    def _open(self, lo: int, hi: int, files: list[str] | None = None, **kwargs: Any) -> Trace:
        """The rows of the files that may hold rows in [lo, hi) (`files` where given), as `open_trace` reads."""
        # req as read (dictionary codes): the rules read requests by code, never the strings
        return open_trace(self.path, instances=list(self.instances) if self.instances else None, warn=False,
                          only_files=self.meeting([(lo, hi)]) if files is None else files, req_dictionary=True,
                          **kwargs)

    def plan_groups(self, columns: Sequence[str] = PLAN_COLUMNS) -> list[PlanFile]:
        """The plan's input (`plan_windows`): per file, its `columns` in batches, with the rows `open_trace`
        keeps; `plan_windows` reads the files on its threads, and a file it cannot decode is skipped (`corrupt`)."""
        expression = _filter_expression(list(self.instances) if self.instances else None, self.config.since_ns,
                                        self.config.until_ns, keep_config=True)  # what open_trace keeps

        def batches(name: str) -> Any:
            # req as the files' dictionary codes: the plan groups by code, never decoding the strings
            return dataset([name], format=_DICTIONARY_READ).to_batches(columns=list(columns), filter=expression,
                                                                      batch_size=1 << 20)

        def skip(name: str, exc: BaseException) -> None:
            self.corrupt[name] = describe_unreadable(name, exc)

        return [PlanFile(name, batches, skip) for name in self.files]

    def rows(self, start: int, end: int, plan: WindowPlan, k: int) -> Trace:
        cfg = self.config
        since = start if cfg.since_ns is None else max(start, int(cfg.since_ns))
        until = end if cfg.until_ns is None else min(end, int(cfg.until_ns))
        if len(self.corrupt) == len(self.files):  # every file of the partition corrupt: no rows, as a whole read
            return Trace.from_table(SCHEMA.empty_table(), path=self.path)
        trace = self._open(since, until, since_ns=since, until_ns=until)
        outside = [int(t) for t in plan.every_ts.tolist() if not since <= t < until]
        carried = plan.carried[k]
        if not outside and not carried:
            return trace
        if carried or len(plan.every_ts) > EXACT_FETCH:
            more = self._extra(outside, carried, since, plan.ends)
        else:  # the EVERY_WINDOW rows alone, each fetched by its ts: read once for every window
            if self._every is None:
                self._every = self._extra([int(t) for t in plan.every_ts.tolist()], {}, since)
            more = self._every
        keep = pc.and_(window_rows(more, since, until, carried), pc.invert(in_time(more.column("ts_ns"), since, until)))
        table = unified(pa.concat_tables([trace.table, more.filter(keep)]))  # both read by `_open`: req as codes
        return Trace(table=table, path=trace.path, manifest=trace.manifest, files=trace.files,
                     skipped=trace.skipped, warnings=trace.warnings, window_start_ns=trace.window_start_ns,
                     window_source=trace.window_source)

    def _extra(self, outside: list[int], carried: dict[str, int], since: int,
               ends: Mapping[str, int] | None = None) -> pa.Table:
        """The rows a window reads besides its time range: those at the EVERY_WINDOW rows' ts `outside` (or of
        those kinds), and the carried requests' rows before `since`, between each one's first ts and its last
        (`ends`, where known); `rows` keeps what the window analyses. Only the files that may hold them are opened
        (a leak carried from the first hour into every later window of a plot read in pieces is read from the
        files of its own life, not from every file since it began), and the rows of a request that ended before
        `since` are read once and kept for the later windows that carry it again (bench/long_trace.py's 60M
        events, the blocks figure in 12 pieces, each carrying up to 23 leaks: the pieces' reads CPU 42.2 s reading
        from the first leak's start, 16.4 s from each leak's life, 7.4 s with the ended ones kept). Without
        carried requests these are the same for every window (the EVERY_WINDOW rows of the whole trace, then
        filtered per window), so `rows` reads them once where they are few (EXACT_FETCH): each such read costs a
        row group per file holding one, 30-40 ms CPU a window (5M events, one core; 11 of the 12 windows at 60M)."""
        ended = {name for name in carried if ends is not None and int(ends.get(name, OPEN)) < since}
        again = ended & self._ended  # read by an earlier window: `rows` keeps those it carries of the rows kept
        kept = list(self._ended_rows) if again else []
        carried = {name: first for name, first in carried.items() if name not in again}
        if not outside and not carried:
            return pa.concat_tables(kept)
        exact = len(outside) <= EXACT_FETCH
        terms = [ds.field("ts_ns") == t for t in outside] if exact else [ds.field("kind").isin(list(EVERY_WINDOW))]
        spans = [(t, t + 1) for t in outside] if exact else [(min(outside), max(outside) + 1)] if outside else []
        lives = {name: (first, min(int(ends.get(name, since)) if ends else since, since - 1) + 1)
                 for name, first in carried.items()}
        if len(lives) <= EXACT_FETCH:  # each request's own rows, between its first ts and its last before since
            terms += [(ds.field("req") == name) & (ds.field("ts_ns") >= lo) & (ds.field("ts_ns") < hi)
                      for name, (lo, hi) in lives.items()]
        elif lives:
            terms.append(ds.field("req").isin(list(carried)) & (ds.field("ts_ns") >= min(carried.values()))
                         & (ds.field("ts_ns") < since))
        spans += lives.values()
        where = terms[0]
        for term in terms[1:]:
            where = where | term
        table = self._open(min(lo for lo, _ in spans), max(hi for _, hi in spans), rows=where,
                           files=self.meeting(spans)).table
        new = ended & carried.keys()
        if new:  # their rows (all before since), kept for the later windows
            mask = pc.and_(pc.is_in(dictionary_decoded(table.column("req")), value_set=pa.array(sorted(new))),
                           pc.less(table.column("ts_ns"), pa.scalar(since, pa.int64())))
            self._ended_rows.append(table.filter(pc.fill_null(mask, False)))
            self._ended |= new
        return pa.concat_tables([table, *kept]) if kept else table

    def meeting(self, spans: Sequence[tuple[int, int]]) -> list[str]:
        """The files that may hold rows in any of the spans [lo, hi) (by their footers): a read opens only those."""
        lo = np.array([a for a, _ in spans], np.int64)
        hi = np.array([b for _, b in spans], np.int64)
        files = [(n, s) for n, s in zip(self.files, self.spans) if n not in self.corrupt]
        out = [name for name, span in files
               if span is None or bool(np.any((lo <= span[1]) & (hi > span[0])))]
        return out or [n for n, _ in files[:1]]


def _events_in(trace: Trace, a: int, b: int) -> int:
    """The window's own events: its rows with a <= ts < b (not the lookback's, the carried or EVERY_WINDOW rows
    outside)."""
    return int(pc.sum(in_time(trace.table.column("ts_ns"), a, b)).as_py() or 0)


def finding_requests(frame: pd.DataFrame) -> list[list[str]]:
    """Per finding, the requests it names on its own instance: `req`, `requests`, and its evidence's."""
    out = []
    for req, requests, evidence, instance in zip(frame["req"], frame["requests"], frame["evidence"],
                                                 frame["instance"]):
        names = [] if req is None or (not isinstance(req, str) and pd.isna(req)) else [str(req)]
        names.extend(str(r) for r in (requests if isinstance(requests, (list, tuple)) else ()))
        for ev in evidence if isinstance(evidence, (list, tuple)) else ():
            if isinstance(ev, dict) and ev.get("req") is not None and ev.get("instance", instance) == instance:
                names.append(str(ev["req"]))
        out.append(names)
    return out


#: `finding_end`'s value for a finding with neither a request nor a ts
NO_END = np.iinfo(np.int64).min


def finding_end(frame: pd.DataFrame, last_ts: Mapping[str, int]) -> np.ndarray:
    """Per finding, the time from which a window holds what it is about: the last row (`last_ts`, the whole
    trace's) of the latest request it names, else its own ts; NO_END where it has neither."""
    out = np.full(len(frame), NO_END, np.int64)
    for i, (names, ts) in enumerate(zip(finding_requests(frame), frame["ts_ns"])):  # few: findings
        last = [last_ts[n] for n in names if n in last_ts]
        if last:
            out[i] = max(last)
        elif ts is not None and not pd.isna(ts):
            out[i] = int(ts)
    return out


def owner(frame: pd.DataFrame, plan: WindowPlan) -> np.ndarray:
    """The window that owns each finding (module docstring, step 4); -1: none (no request, no ts)."""
    end = finding_end(frame, plan.last_ts)
    return np.where(end == NO_END, -1, plan.window_of(end))


@dataclass(frozen=True)
class WindowEnd:
    """A window read out of a longer trace that goes on after it (`read_time_window`): of a request still open at
    its end the window holds a beginning only, so a finding about one ("still held at the end of the trace", "never
    finished") is not the window's to make. The windowed analysis leaves such a finding to a later window
    (`owner`); a plot or export of the window leaves it out (`judged`)."""

    #: where the window's rows end (exclusive)
    end_ns: int
    #: per request id, the ts of its last row in the whole trace (`WindowPlan.row_ends`: a request that never
    #: finishes, with no row after the window's, is held whole; the rules judge it against the whole trace's end,
    #: `AnalysisContext.span_ns`)
    last_ts: Mapping[str, int]

    def judged(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The findings the window holds whole: those whose `finding_end` is before its end."""
        if len(frame) == 0:
            return frame
        return frame[finding_end(frame, self.last_ts) < self.end_ns].reset_index(drop=True)


def judged(ctx: AnalysisContext, frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` less the findings the context's rows cannot judge (`AnalysisContext.window_end`); all of them on a
    trace that ends where the run does."""
    return frame if ctx.window_end is None else ctx.window_end.judged(frame)


@dataclass
class TimeWindow:
    """One time window [since, until) of a long trace, planned as the windowed analysis plans its windows
    (`plan_time_windows`): read from `start` (the oldest request or step open at `since`, at most the lookback
    before it, but at least a little before it: READ_AHEAD events, or the lookback's where fewer, so that the idle
    gap that straddles `since` is read whole) to `end`, with the carried requests' own rows. A long window is read
    in pieces, each a TimeWindow of the same plan: the pieces' own spans [`since`, `until`) tile it."""

    plan: WindowPlan
    #: the window's index in `plan` (its cuts are the trace's start, since, the pieces' cuts, until, the end of its
    #: read (`end`) and the trace's end)
    index: int
    #: about how many rows a read of it holds at most: its events, the lookback's and the look-ahead's
    rows: int
    #: the window lies outside the rows' time range (after their last, or before their first): nothing to read
    outside: bool = False
    #: the cut its read ends at: index + 2 for the last piece (past until, `end`), index + 1 for the others
    ends_at: int | None = None

    @property
    def since(self) -> int:
        """Where its own span begins: the cut at `index`."""
        return int(self.plan.cuts[self.index])

    @property
    def until(self) -> int:
        """Where its own span ends (exclusive): the next cut."""
        return int(self.plan.cuts[min(self.index + 1, len(self.plan))])

    @property
    def start(self) -> int:
        return int(self.plan.starts[self.index])

    @property
    def end(self) -> int:
        """Where its read ends. The last piece's: at the end of the requests and steps open at until, so that the
        read holds them whole, but a little past until at least (READ_AHEAD events, or the lookback's where fewer:
        an idle gap between steps that straddles until is read whole) and the lookback's events at most (the
        findings about a request open for longer are left out: `window_end`). Another piece's: at its until (the
        findings about a request open there are left out)."""
        return int(self.plan.cuts[min(self.index + 2 if self.ends_at is None else self.ends_at, len(self.plan))])

    @property
    def window_end(self) -> WindowEnd | None:
        """None where the read runs to the end of the trace (or reads none of it)."""
        if self.outside or self.end >= int(self.plan.cuts[-1]):
            return None
        return WindowEnd(self.end, self.plan.ends)


#: Events a time window's read holds before its start and after its end at least (`TimeWindow.start`, `end`).
READ_AHEAD = 1 << 16
#: Cuts before and after every row (`plan_windows` leaves them out): a window in pieces from the start, to the end.
LOWEST, HIGHEST = np.iinfo(np.int64).min, np.iinfo(np.int64).max


def plan_time_windows(source: PathSource, since_ns: int | None, until_ns: int | None, config: AnalysisConfig,
                      piece_events: int = 0) -> list[TimeWindow]:
    """Plan the window [since_ns, until_ns) of `source`'s rows (None: from the start, to the end): the cheap pass
    of `plan_windows` with those two cuts, and the lookback of the windowed analysis (`config.window_lookback`,
    else half of `config.window_events` where that is positive, else half of DEFAULT_WINDOW_EVENTS). With
    `piece_events`, the window is cut into pieces of about that many events, each read on its own (a plot of
    hours: memory bounded by a piece); else it is one piece."""
    events = int(config.window_events)
    lookback = int(config.window_lookback) or (events if events > 0 else DEFAULT_WINDOW_EVENTS) // 2
    cuts = [c for c in (since_ns, until_ns) if c is not None]
    if piece_events > 0:  # the pieces lie between two cuts: the start and the end of the rows where not given
        cuts = [LOWEST if since_ns is None else since_ns, HIGHEST if until_ns is None else until_ns]
    # with the blocks: a request whose rows all lie before the window yet leave it holding blocks (a leak older
    # than the window) is carried, so that the window shows what it holds
    times = TimeCuts(cuts, margin=(min(READ_AHEAD, lookback), lookback), ahead=until_ns is not None,
                     whole_steps=True, split=max(int(piece_events), 0))
    plan = plan_windows(source.plan_groups([*PLAN_COLUMNS, "instance", "blocks"]), DEFAULT_WINDOW_EVENTS, lookback,
                        rows=source.plan_rows, jobs=max(1, int(config.jobs)), times=times, row_ends=True)
    if (since_ns is not None and since_ns >= int(plan.cuts[-1])
            or until_ns is not None and until_ns <= int(plan.cuts[0])):
        return [TimeWindow(plan, int(plan.window_of(since_ns)) if since_ns is not None else 0, 0, True)]
    first = int(plan.window_of(since_ns)) if since_ns is not None else 0
    last = int(plan.window_of(until_ns - 1)) if until_ns is not None else len(plan) - 1
    last = max(last, first)
    return [TimeWindow(plan, k, int(plan.events[k]) + (lookback if k else 0)
                       + (lookback if until_ns is not None and k == last else 0),
                       ends_at=None if k == last else k + 1)
            for k in range(first, last + 1)]


def read_time_window(source: MemorySource | PathSource, window: TimeWindow) -> Trace:
    """The rows of a planned window (`plan_time_windows`), marked as starting mid-run where they do; of a window
    outside the rows' time range, only the rows every window reads (the configuration)."""
    if window.outside:
        stop = int(window.plan.cuts[-1])
        return source.rows(stop, stop, window.plan, 0)
    return _window_rows(source, window.plan, window.index, window.end)


def _window_rows(source: MemorySource | PathSource, plan: WindowPlan, k: int, end: int | None = None) -> Trace:
    """Window k's rows (module docstring, step 2) up to `end` (None: its cut), a window starting at its c_k
    (`later_window`) after the trace's first ts."""
    start, end = int(plan.starts[k]), int(plan.cuts[k + 1]) if end is None else end
    trace = source.rows(start, end, plan, k)
    if start > int(plan.cuts[0]):
        trace.window_start_ns, trace.window_source = later_window(
            trace.window_start_ns, trace.window_source, start, "since")
    return trace


#: Why a finding about a request carried alone into its window may differ from the whole-trace analysis's.
CARRIED_WHY = ("the request began more than the lookback before the window's cut: its own rows are carried, the "
               "steps and other requests before the window's start are not (step counts may be lower)")


def carried_marked(frame: pd.DataFrame, carried: dict[str, int], start: int) -> pd.DataFrame:
    """The window's findings, those naming a request carried alone into it (module docstring, "Exact") marked
    `extra.windowed`."""
    if not carried or len(frame) == 0:
        return frame
    hit = [bool(set(names) & carried.keys()) for names in finding_requests(frame)]
    if not any(hit):
        return frame
    frame = frame.copy()
    frame["extra"] = [dict(e or {}, windowed={"start_ns": start, "carried": sorted(set(n) & carried.keys()),
                                              "why": CARRIED_WHY}) if h else e
                      for e, h, n in zip(frame["extra"], hit, finding_requests(frame))]
    return frame


@dataclass
class WindowedResult:
    frames: list[pd.DataFrame]
    events: int
    warnings: list[str]
    windows: int
    #: requests carried alone into some window (opened more than the lookback before its cut)
    carried: int
    #: per window, what `summarize(ctx, frames)` returned
    summaries: list[Any] = field(default_factory=list)


def analyze_windows(source: MemorySource | PathSource, rules: Sequence[Rule], config: AnalysisConfig,
                    span: tuple[int, int] | None, instance: str = "", window_events: int | None = None,
                    lookback: int | None = None, progress: Callable[[Any, Any], None] | None = None,
                    summarize: Callable[[AnalysisContext, list[pd.DataFrame]], Any] | None = None) -> WindowedResult:
    """The rules' findings on one instance's rows, window by window (module docstring); per rule, the windows'
    owned findings in window order."""

    # as open_trace reads (pdtrace.trace.reader) and analyze() runs the rules: the plan's reads and arrays too
    with system_memory_pool(), allocation_settings():
        return _analyze_windows(source, rules, config, span, instance, window_events, lookback, progress, summarize)


def _analyze_windows(source: MemorySource | PathSource, rules: Sequence[Rule], config: AnalysisConfig,
                     span: tuple[int, int] | None, instance: str, window_events: int | None, lookback: int | None,
                     progress: Callable[[Any, Any], None] | None,
                     summarize: Callable[[AnalysisContext, list[pd.DataFrame]], Any] | None) -> WindowedResult:
    window_events = int(window_events or (config.window_events if config.window_events > 0 else 0)
                        or DEFAULT_WINDOW_EVENTS)
    lookback = lookback if lookback is not None else (int(config.window_lookback) or None)
    jobs = max(1, int(config.jobs))
    plan = plan_windows(source.plan_groups(), window_events, lookback, rows=source.plan_rows, jobs=jobs)
    frames: list[list[pd.DataFrame]] = [[] for _ in rules]
    warnings: list[str] = list(source.warnings)
    summaries: list[Any] = []
    events: list[int] = []  # per window, its events (the plan's are estimates where it sampled the ts)
    total = len(plan)
    last = total - 1
    for k in range(total):  # per window: few
        began = time.perf_counter()
        start, end = int(plan.starts[k]), int(plan.cuts[k + 1])
        trace = _window_rows(source, plan, k)
        ctx = AnalysisContext(trace=trace, config=config, span_ns=span)
        analysed = len(trace)
        events.append(_events_in(trace, int(plan.cuts[k]), end))

        def keep(i: int, frame: pd.DataFrame, rule: Rule, k: int = k, start: int = start, end: int = end
                 ) -> pd.DataFrame:
            """The findings window k owns (module docstring, step 4); a per-window rule's, all, marked."""
            if len(frame) and rule.per_window:
                frame = frame.copy()
                frame["extra"] = [dict(e or {}, windowed={"start_ns": start, "end_ns": end,
                                                          "why": rule.per_window}) for e in frame["extra"]]
                frame["message"] = [f"window {k + 1}/{total} ({(end - start) / 1e9:.1f} s from ts_ns {start}): "
                                    f"{m}" for m in frame["message"]]
            elif len(frame):
                owners = owner(frame, plan)
                frame = carried_marked(frame[(owners == k) | ((owners < 0) & (k == last))], plan.carried[k],
                                       start)
            frames[i].append(frame)
            return frame

        # engine's, looked up at each call (tests/test_plan.py counts the calls through it)
        result = engine.analyze_slice(ctx, rules, jobs, keep=keep, summarize=summarize)
        if summarize is not None:
            summaries.append(result.summary)
        warnings.extend(w for w in trace.warnings if w not in warnings)
        del ctx, trace
        if progress is not None:
            info = WindowInfo(instance, k, total, events[-1], analysed,
                              seconds=time.perf_counter() - began)
            progress(info, info)
    out = []
    for parts in frames:
        parts = [p for p in parts if len(p)]
        out.append(pd.concat(parts, ignore_index=True) if parts else None)
    return WindowedResult([empty_findings() if f is None else f for f in out], sum(events), warnings,
                          total, len({r for c in plan.carried for r in c}), summaries)


def __getattr__(name: str) -> Any:
    """`PER_WINDOW` ({rule id: why}), the table the rules measured per window were listed in before each declared it
    on its `Rule` (`Rule.per_window`), built from the registered rules. Kept for one release for code written
    against it; read `Rule.per_window`."""
    if name == "PER_WINDOW":
        from pdtrace.analysis.registry import load_rules  # the registry loads every rule module: only when asked

        return {r.id: r.per_window for r in load_rules(errors=[]).values() if r.per_window}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The request table: one row per request (instance, dp_rank, req) with the moments of its lifecycle.

Algorithm: every scheduler row that names a request gets its request key (`rk`, see columns.py). For each kind the
first or last position per key is one `np.minimum.at` / `np.maximum.at` over that kind's rows (positions in the
global time order, reduced in int32), turned back into rows, timestamps and steps by indexing. Counts are
`np.add.at` (req_sched) or `np.bincount`. Transfer closes are searched after the moment they belong to: a send closes
at the first `kv_send_done` or `kv_expire` after the finish, a receive at the first `kv_recv_done` after
`req_wait_kv`, else (no `kv_recv_done` follows) at the first per-request `kv_recv_fail` after it: vLLM 0.33 keeps a
failed load's blocks until the worker reports the receive finished (`_update_waiting_for_remote_kv`,
`finish_requests` delaying the free), so a failure closes the receive only where no completion comes. A request
preempted while it waits may wait again: the block rules ask whether a receive is open at a moment through the
receive *windows* (one per `req_wait_kv`, closed the same way; `recv_window_at`, `recv_open_at`), the first-wait
columns stay what the request table shows.
`delay_free` is the first `req_finish`'s column; where the recorder left it null it follows from the request's
`req_add` detail as the connector decides it (NIXL's `request_finished`: a `remote_decode` request finished by its
length cap keeps its blocks for the peer's read). Only `req_add` rows with a `detail` are JSON-parsed (one per
request, never per event; for delay_free only when a finish lacks it).

`request_state(ctx)` holds the same facts as numpy arrays of positions indexed by `rk` (what the rules use);
`request_table(ctx)` is the DataFrame of timestamps for notebooks, `show`, plots and the scheduling rules.
A request id reused within one scheduler after its request finished is one row per lifetime (columns.py's request
keys; `lifetime` 0, 1, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.analysis.columns import (NO, Columns, columns, first_per_key, last_before, last_per_key, next_at_or_after,
                                     positions, request_keys)
from pdtrace.analysis.parallel import shared_table

REQUEST_COLUMNS = (
    "instance", "dp_rank", "req", "role", "add_ts", "first_sched_ts", "first_sched_step", "last_sched_ts",
    "last_sched_step", "n_sched_steps", "wait_kv_ts", "recv_done_ts", "recv_fail_ts", "finish_ts", "finish_step",
    "finish_reason", "finish_status", "delay_free", "send_done_ts", "expire_ts", "last_free_ts", "n_preempt",
    "last_preempt_ts", "remote_prefill", "remote_decode", "remote_instance", "remote_req", "lifetime",
)


@dataclass
class RequestState:
    """Lifecycle positions per request key (index = rk); NO (-1) where it never happened."""

    n: int
    sk: np.ndarray
    add_pos: np.ndarray
    first_sched_pos: np.ndarray
    last_sched_pos: np.ndarray
    n_sched: np.ndarray
    wait_kv_pos: np.ndarray
    recv_done_pos: np.ndarray
    recv_fail_pos: np.ndarray
    recv_close_pos: np.ndarray     # first kv_recv_done / kv_recv_fail after req_wait_kv
    finish_pos: np.ndarray
    delay_free: np.ndarray         # bool, from the first req_finish
    send_done_pos: np.ndarray      # first kv_send_done anywhere
    expire_pos: np.ndarray
    send_close_pos: np.ndarray     # first kv_send_done / kv_expire after the finish
    last_free_pos: np.ndarray
    n_preempt: np.ndarray
    last_preempt_pos: np.ndarray
    last_pos: np.ndarray           # the request's last scheduler event
    # receive windows, one per req_wait_kv (a preempted request may wait again), sorted by (rk, position): the
    # req_wait_kv and the position that closed it (NO while open)
    window_rk: np.ndarray = None  # type: ignore[assignment]
    window_start: np.ndarray = None  # type: ignore[assignment]
    window_close: np.ndarray = None  # type: ignore[assignment]
    n_windows: np.ndarray = None  # type: ignore[assignment]  # per rk
    #: per rk: a receive was pending at the finish although no req_wait_kv of the request is in the trace (a window
    #: that starts mid-run): the first req_finish's status (the request's just before it) is WAITING_FOR_REMOTE_KVS,
    #: or a kv_recv_done / kv_recv_fail of the request follows the finish
    waiting_kv_at_finish: np.ndarray = None  # type: ignore[assignment]

    @property
    def first_known_pos(self) -> np.ndarray:
        """The earliest of add, wait_kv, first schedule and finish (NO if none): when the trace first knew it."""
        big = np.iinfo(np.int64).max
        stacked = np.stack([self.add_pos, self.wait_kv_pos, self.first_sched_pos, self.finish_pos])
        first = np.where(stacked >= 0, stacked, big).min(axis=0) if self.n else np.empty(0, np.int64)
        return np.where(first == big, NO, first)

    def recv_window_at(self, rk: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, close) of the request's receive window begun last before pos (its latest `req_wait_kv`), NO
        where it has none; close is NO while the window is open.

        A request with one window at most (nearly all) is answered from its first-wait columns by indexing; only
        the requests that waited again are searched (a searchsorted over their windows): asked for every freed
        block, the search for all took 0.14 s of use_after_free's 0.25 s at 10M events."""
        rk = np.asarray(rk)
        pos = np.asarray(pos)
        first = self.wait_kv_pos[rk]
        start = np.where((first >= 0) & (first < pos), first, NO)
        close = np.where(start >= 0, self.recv_close_pos[rk], NO)
        again = np.flatnonzero(self.n_windows[rk] > 1) if len(rk) else np.empty(0, np.int64)
        if len(again):
            idx = last_before(rk[again], pos[again], self.window_rk, self.window_start, strict=True)
            ok = idx >= 0
            at = np.maximum(idx, 0)
            start[again] = np.where(ok, self.window_start[at], NO)
            close[again] = np.where(ok, self.window_close[at], NO)
        return start, close

    def recv_open_at(self, rk: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Whether a receive is open at pos: after the request's latest req_wait_kv before pos, before that
        window closed."""
        start, close = self.recv_window_at(rk, pos)
        return (start >= 0) & ((close < 0) | (close > pos))

    def recv_open_until(self, rk: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """`recv_open_at`, counting the event at pos as still inside the receive: what a completion at pos
        completes (the receive its own `kv_recv_done` closes was open when it arrived)."""
        start, close = self.recv_window_at(rk, pos)
        return (start >= 0) & ((close < 0) | (close >= pos))

    def finished_by(self, cols: Columns, rows: np.ndarray) -> np.ndarray:
        """For free rows: the request had finished when it gave these blocks up, the free being its final one (a
        `req_finish` before the free, or the free `_free_request` itself makes: the recorder writes it just before
        `req_finish`, in the same step, with no `req_sched` between). After such a free vLLM forgets the request
        (`_free_blocks` deletes it from `self.requests`)."""
        rk = cols.rk[rows]
        pos = cols.pos[rows]
        fin = self.finish_pos[rk]
        fin_row = cols.order[np.maximum(fin, 0)] if cols.n else fin
        same_step = cols.step[fin_row] == cols.step[rows]
        last_sched = self.last_sched_pos[rk]
        at_finish = (fin > pos) & same_step & ~((last_sched > pos) & (last_sched < fin))
        return ((fin >= 0) & (fin < pos)) | at_finish

    def send_open_at(self, rk: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Whether a send is open at pos: finished with delay_free (not for a pending receive: a receive window
        open at the finish, or the finish's status WAITING_FOR_REMOTE_KVS), not yet sent."""
        fin = self.finish_pos[rk]
        close = self.send_close_pos[rk]
        recv_pending_at_finish = self.recv_open_at(rk, np.where(fin >= 0, fin, 0))
        if self.waiting_kv_at_finish is not None:
            recv_pending_at_finish |= self.waiting_kv_at_finish[rk]
        return ((fin >= 0) & self.delay_free[rk] & ~recv_pending_at_finish & (fin < pos)
                & ((close < 0) | (close > pos)))


def _first(cols: Columns, kinds: tuple[str, ...], n: int, extra_mask: np.ndarray | None = None) -> np.ndarray:
    rows = cols.req_rows(*kinds)
    if extra_mask is not None:
        rows = rows[extra_mask[rows]]
    return first_per_key(cols.rk[rows], cols.pos[rows], n)


def _first_after(cols: Columns, kinds: tuple[str, ...], after: np.ndarray, n: int,
                 extra_mask: np.ndarray | None = None) -> np.ndarray:
    """First position per key of the given kinds strictly after `after[rk]` (which is -1 where there is none)."""
    rows = cols.req_rows(*kinds)
    if extra_mask is not None:
        rows = rows[extra_mask[rows]]
    rk = cols.rk[rows]
    pos = cols.pos[rows]
    keep = (after[rk] >= 0) & (pos > after[rk])
    return first_per_key(rk[keep], pos[keep], n)


def remote_flags(cols: Columns, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(remote_prefill, remote_decode, remote_instance, remote_req) per request key, from the detail of its
    `req_add` rows (one JSON parse per request that has one). A request naming its `remote_instance` without a
    `remote_req` has the peer's request under its own id (vLLM before 0.28 has no remote_request_id: one id on
    both sides), as the rules and `show --req` read it."""
    prefill = np.zeros(n, bool)
    decode = np.zeros(n, bool)
    instance = np.full(n, None, object)
    remote_req = np.full(n, None, object)
    detail = cols.table.column("detail")
    rows = cols.req_rows("req_add")
    rows = rows[pc.is_valid(detail.take(pa.array(rows))).to_numpy(zero_copy_only=False)] if len(rows) else rows
    for row, d in zip(rows.tolist(), cols.details(rows)):  # one per request
        key = int(cols.rk[row])
        prefill[key] |= bool(d.get("remote_prefill") or d.get("do_remote_prefill"))
        decode[key] |= bool(d.get("remote_decode") or d.get("do_remote_decode"))
        if d.get("remote_instance") is not None:
            instance[key] = str(d["remote_instance"])
        if d.get("remote_req") is not None:
            remote_req[key] = str(d["remote_req"])
    named = np.flatnonzero(pd.notna(instance) & pd.isna(remote_req))
    if len(named):
        remote_req[named] = cols.rk_names["req"].to_numpy(object)[named]
    return prefill, decode, instance, remote_req


def _implied_delay_free(cols: Columns, finish_rows: np.ndarray) -> np.ndarray:
    """delay_free as the connector decides it, for finish rows whose column is null: the request's req_add says
    `remote_decode` and it finished by its length cap (NIXL keeps the blocks for the peer's read only then)."""
    _, decode, _, _ = cols.once("requests.remote_flags", lambda: remote_flags(cols, cols.n_requests))
    reason = cols.codes("reason")[0][finish_rows]
    return decode[cols.rk[finish_rows]] & (reason == cols.code_of("reason", "length"))


def _receive_windows(cols: Columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One receive window per req_wait_kv row, sorted by (rk, position): it closes at the request's first
    kv_recv_done after it, else (none follows) at its first per-request kv_recv_fail after it."""
    rows = cols.req_rows("req_wait_kv")
    rk = cols.rk[rows].astype(np.int64)
    start = cols.pos[rows].astype(np.int64)
    order = np.lexsort((start, rk))
    rk, start = rk[order], start[order]

    def first_after(kind: str) -> np.ndarray:
        other = cols.req_rows(kind)
        idx = next_at_or_after(rk, start, cols.rk[other], cols.pos[other], strict=True)
        return np.where(idx >= 0, cols.pos[other][np.maximum(idx, 0)] if len(other) else NO, NO)

    done, fail = first_after("kv_recv_done"), first_after("kv_recv_fail")
    return rk, start, np.where(done >= 0, done, fail)


def _count_per_key(keys: np.ndarray, n: int) -> np.ndarray:
    """`np.bincount(keys, minlength=n)` as one `np.add.at` (bincount first copies int32 keys to int64)."""
    counts = np.zeros(n, np.int64)
    np.add.at(counts, keys, 1)
    return counts


def _build_state(cols: Columns) -> RequestState:
    n = cols.n_requests
    rk = cols.rk
    pos = cols.pos
    sched = cols.req_rows("req_sched")
    sched_rk = cols.req_keys("req_sched")
    sched_pos = pos[sched]  # most rows of a trace: read once for the first and the last schedule
    finish_rows = cols.req_rows("req_finish")
    finish_pos = first_per_key(rk[finish_rows], pos[finish_rows], n)
    delay_free = np.zeros(n, bool)
    firsts = finish_pos[rk[finish_rows]] == pos[finish_rows]
    delay_value, delay_valid = cols.bools_at("delay_free", finish_rows[firsts])
    if not delay_valid.all():
        delay_value = np.where(delay_valid, delay_value, _implied_delay_free(cols, finish_rows[firsts]))
    delay_free[rk[finish_rows[firsts]]] = delay_value
    waiting_kv_at_finish = np.zeros(n, bool)
    waiting_kv_at_finish[rk[finish_rows[firsts]]] = (
        cols.codes("status")[0][finish_rows[firsts]] == cols.code_of("status", "WAITING_FOR_REMOTE_KVS"))
    wait_kv_pos = _first(cols, ("req_wait_kv",), n)
    recv_fail_pos = _first(cols, ("kv_recv_fail",), n)
    window_rk, window_start, window_close = _receive_windows(cols)
    recv_done_after_wait = _first_after(cols, ("kv_recv_done",), wait_kv_pos, n)
    recv_fail_after_wait = _first_after(cols, ("kv_recv_fail",), wait_kv_pos, n)
    preempt_rows = cols.req_rows("req_preempt")
    free_rows = cols.req_rows("blocks_free")
    state = RequestState(
        n=n,
        sk=cols.request_sk if n else np.empty(0, np.int32),
        add_pos=_first(cols, ("req_add",), n),
        first_sched_pos=first_per_key(sched_rk, sched_pos, n),
        last_sched_pos=last_per_key(sched_rk, sched_pos, n),
        n_sched=_count_per_key(sched_rk, n),
        wait_kv_pos=wait_kv_pos,
        recv_done_pos=_first(cols, ("kv_recv_done",), n),
        recv_fail_pos=recv_fail_pos,
        recv_close_pos=np.where(recv_done_after_wait >= 0, recv_done_after_wait, recv_fail_after_wait),
        finish_pos=finish_pos,
        delay_free=delay_free,
        send_done_pos=_first(cols, ("kv_send_done",), n),
        expire_pos=_first(cols, ("kv_expire",), n),
        send_close_pos=_first_after(cols, ("kv_send_done", "kv_expire"), finish_pos, n),
        last_free_pos=last_per_key(rk[free_rows], pos[free_rows], n),
        n_preempt=np.bincount(rk[preempt_rows], minlength=n) if n else np.empty(0, np.int64),
        last_preempt_pos=last_per_key(rk[preempt_rows], pos[preempt_rows], n),
        last_pos=np.zeros(0, np.int64),
        window_rk=window_rk, window_start=window_start, window_close=window_close,
        n_windows=np.bincount(window_rk, minlength=n) if n else np.zeros(0, np.int64),
        waiting_kv_at_finish=waiting_kv_at_finish,
    )
    received_later = ((state.recv_done_pos > finish_pos) | (state.recv_fail_pos > finish_pos)) & (finish_pos >= 0)
    state.waiting_kv_at_finish |= received_later & (wait_kv_pos < 0)
    # the request's last lifecycle event, from the moments above (no extra pass over the rows)
    state.last_pos = np.max(np.stack([state.add_pos, state.last_sched_pos, state.wait_kv_pos, state.recv_done_pos,
                                      state.recv_fail_pos, state.finish_pos, state.send_done_pos, state.expire_pos,
                                      state.last_free_pos, state.last_preempt_pos]), axis=0) if n else state.last_pos
    return state


@shared_table(positions, request_keys, cost=0.13)
def request_state(ctx: Any) -> RequestState:
    """Lifecycle positions per request key, cached on the context."""
    return ctx.cached("request_state", lambda: _build_state(columns(ctx)))


def last_sched_before(ctx: Any, rk: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Row of the request's last req_sched before pos (NO if none).

    Most asks come after the request's last schedule (a finish, a completion), where the answer is the request's
    last req_sched; only the others (e.g. a preemption followed by a resume) search the req_sched rows, of those
    requests only."""
    cols = columns(ctx)
    st = request_state(ctx)
    out = np.full(len(rk), NO, np.int64)
    if len(rk) == 0:
        return out
    last = st.last_sched_pos[rk]
    easy = last < pos
    out[easy & (last >= 0)] = cols.order[last[easy & (last >= 0)]]
    hard = np.flatnonzero(~easy)
    if len(hard):
        wanted = np.zeros(cols.n_requests, bool)
        wanted[rk[hard]] = True
        rows = cols.req_rows("req_sched")
        rows = rows[wanted[cols.req_keys("req_sched")]]
        idx = last_before(rk[hard], pos[hard], cols.rk[rows], cols.pos[rows], strict=True)
        out[hard] = np.where(idx >= 0, rows[np.maximum(idx, 0)] if len(rows) else NO, NO)
    return out


def _rows(cols: Columns, pos: np.ndarray) -> np.ndarray:
    return cols.order[np.where(pos >= 0, pos, 0)] if len(pos) else np.empty(0, np.int64)


def _nullable(values: np.ndarray, valid: np.ndarray, dtype: str) -> Any:
    arr = pd.array(values, dtype=dtype)
    arr[~valid] = pd.NA
    return arr


def _ts(cols: Columns, pos: np.ndarray) -> Any:
    return _nullable(cols.ts[_rows(cols, pos)], pos >= 0, "Int64")


def _step(cols: Columns, pos: np.ndarray) -> Any:
    step = cols.step[_rows(cols, pos)]
    return _nullable(step, (pos >= 0) & (step >= 0), "Int64")


def _code_names(cols: Columns, name: str, pos: np.ndarray) -> Any:
    codes, names = cols.codes(name)
    c = codes[_rows(cols, pos)]
    lookup = np.asarray(list(names) + [None], dtype=object)
    return pd.array(lookup[np.where((pos >= 0) & (c >= 0), c, len(names))], dtype="string")


def _remote_fields(cols: Columns, n: int) -> dict[str, Any]:
    prefill, decode, instance, remote_req = cols.once("requests.remote_flags", lambda: remote_flags(cols, n))
    return {
        "remote_prefill": pd.array(prefill, dtype="boolean"),
        "remote_decode": pd.array(decode, dtype="boolean"),
        "remote_instance": pd.array(instance, dtype="string"),
        "remote_req": pd.array(remote_req, dtype="string"),
    }


def _build_table(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    st = request_state(ctx)
    names = cols.rk_names
    n = st.n
    out = pd.DataFrame({
        "instance": names["instance"].astype("string"),
        "dp_rank": names["dp_rank"],
        "req": names["req"].astype("string"),
        "role": names["role"].astype("string"),
    })
    out["add_ts"] = _ts(cols, st.add_pos)
    out["first_sched_ts"] = _ts(cols, st.first_sched_pos)
    out["first_sched_step"] = _step(cols, st.first_sched_pos)
    out["last_sched_ts"] = _ts(cols, st.last_sched_pos)
    out["last_sched_step"] = _step(cols, st.last_sched_pos)
    out["n_sched_steps"] = st.n_sched.astype(np.int64)
    out["wait_kv_ts"] = _ts(cols, st.wait_kv_pos)
    out["recv_done_ts"] = _ts(cols, st.recv_done_pos)
    out["recv_fail_ts"] = _ts(cols, st.recv_fail_pos)
    out["finish_ts"] = _ts(cols, st.finish_pos)
    out["finish_step"] = _step(cols, st.finish_pos)
    out["finish_reason"] = _code_names(cols, "reason", st.finish_pos)
    out["finish_status"] = _code_names(cols, "status", st.finish_pos)
    out["delay_free"] = _nullable(st.delay_free, st.finish_pos >= 0, "boolean")
    out["send_done_ts"] = _ts(cols, st.send_done_pos)
    out["expire_ts"] = _ts(cols, st.expire_pos)
    out["last_free_ts"] = _ts(cols, st.last_free_pos)
    out["n_preempt"] = st.n_preempt.astype(np.int64)
    out["last_preempt_ts"] = _ts(cols, st.last_preempt_pos)
    for key, value in _remote_fields(cols, n).items():
        out[key] = value
    out["lifetime"] = cols.request_lifetime.astype(np.int64)
    return out[list(REQUEST_COLUMNS)]


def request_table(ctx: Any) -> pd.DataFrame:
    """One row per request (instance, dp_rank, req, lifetime): the lifecycle moments listed in REQUEST_COLUMNS (NA
    where they never happened). Row i is request key i of columns.py, so `request_state(ctx)` arrays index it directly."""
    return ctx.cached("request_table", lambda: _build_table(ctx))

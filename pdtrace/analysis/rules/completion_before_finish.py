"""completion_before_finish: a transfer completion for a request that is not in a state to receive it.

What trips vLLM's `assert request.is_finished()` in `_free_blocks` (`scheduler.py:3065`) for sends and
`RequestStatus.is_finished` (`:3577`) for receives (C02: a send completion for a running request).

Algorithm, per aggregated completion row (`kv_send_done` / `kv_recv_done` with a req):
- The request's state at that moment is the event's `status` where the recorder gave it; otherwise the history: a
  `req_finish` before the completion means finished; a `req_wait_kv` before it whose receive is still open up to
  and including this completion (the receive a `kv_recv_done` closes is the one it completes: requests.py's
  `recv_open_until`) means waiting for remote KV. Both give the same findings (the stripped-field property of
  tests/test_rules_stripped.py).
- `send`: a `kv_send_done` whose request is not finished.
- `recv`: a `kv_recv_done` whose request is neither waiting for remote KV nor finished.
Status `unknown` and completions for requests the trace never saw are double_free's. Evidence: the completion, the
request's last `req_sched` before it, the steps in flight (step_submit without step_output yet), the other
completions of the same update (same scheduler and step), and an `engine_error` of that scheduler right after.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import (FINISHED_STATUSES, Cited, FindingsBuilder, Rule, columns, last_sched_before,
                                      next_at_or_after, request_state, step_index)


def run(ctx: Any) -> pd.DataFrame:
    cols = columns(ctx)
    st = request_state(ctx)
    rows = cols.rows_of("kv_send_done", "kv_recv_done")
    found = FindingsBuilder(ctx, "completion_before_finish")
    rows = rows[cols.rk[rows] >= 0]
    if len(rows) == 0:
        return found.frame()
    rk = cols.rk[rows]
    pos = cols.pos[rows]
    send = cols.codes("kind")[0][rows] == cols.code_of("kind", "kv_send_done")
    status_codes, status_names = cols.codes("status")
    status = status_codes[rows]
    finished_codes = [i for i, s in enumerate(status_names) if s in FINISHED_STATUSES]
    waiting_code = cols.code_of("status", "WAITING_FOR_REMOTE_KVS")
    unknown_code = cols.code_of("status", "unknown")
    has_status = status >= 0
    st_finished = np.isin(status, finished_codes)
    st_waiting = status == waiting_code
    fin = st.finish_pos[rk]
    hist_finished = (fin >= 0) & (fin < pos)
    hist_waiting = st.recv_open_until(rk, pos)  # the receive this kv_recv_done itself completes
    first = st.first_known_pos[rk]
    seen = (first >= 0) & (first < pos)
    finished = np.where(has_status, st_finished, hist_finished)
    waiting = np.where(has_status, st_waiting, hist_waiting)
    usable = np.where(has_status, status != unknown_code, seen)
    bad = usable & np.where(send, ~finished, ~(finished | waiting))
    idx = np.flatnonzero(bad)
    if len(idx) == 0:
        return found.frame()
    si = step_index(ctx)
    sched_rows = last_sched_before(ctx, rk[idx], pos[idx])
    err_rows = cols.rows_of("engine_error")
    err_next = next_at_or_after(cols.sk[rows[idx]], pos[idx], cols.sk[err_rows], cols.pos[err_rows], strict=True)
    found.refs(np.concatenate([rows[idx], sched_rows]))
    all_comp = cols.rows_of("kv_send_done", "kv_recv_done")
    for j, i in enumerate(idx.tolist()):
        row = int(rows[i])
        direction = "send" if send[i] else "recv"
        req = found.ref(row).get("req")
        state = status_names[status[i]] if has_status[i] else (
            "unfinished (from its history)" if direction == "send" else "not waiting for KV (from its history)")
        evidence: list[Cited] = [(row, "completion")]
        if sched_rows[j] >= 0:
            evidence.append((int(sched_rows[j]), "last scheduled before the completion"))
        if fin[i] > pos[i]:
            evidence.append((int(cols.order[fin[i]]), "finished only later"))
        sk = int(cols.sk[row])
        flying = si.in_flight_rows(sk, int(pos[i]))
        evidence += [(int(r), "step in flight") for r in flying[:4]]
        step = cols.step[row]
        others: list[str] = []
        if step >= 0:
            same = all_comp[(cols.sk[all_comp] == sk) & (cols.step[all_comp] == step) & (all_comp != row)]
            for r in same[:4].tolist():
                evidence.append((int(r), "in the same update"))
            others = [str(found.ref(int(r)).get("req")) for r in same[:32].tolist()]
        if err_next[j] >= 0:
            evidence.append((int(err_rows[err_next[j]]), "the engine failed after it"))
        where = "_free_blocks asserts request.is_finished()" if direction == "send" else \
            "_update_from_kv_xfer_finished asserts RequestStatus.is_finished"
        found.add(direction, "error", f"kv_{direction}_done for {req} while it was {state}: vLLM's {where}",
                  evidence, context=f"completion_before_finish:{direction}:{state}",
                  extra={"status": state, "steps_in_flight": len(flying), "others_in_update": others})
    return found.frame()


RULE = Rule(
    id="completion_before_finish",
    summary="a transfer completion for a request that is not finished (send) or not waiting for it (recv)",
    run=run,
    subrules=("send", "recv"),
    needs=(request_state, step_index),
    cost=0.03,
    # the request's add, finish or schedules may lie before the window
    window_policy={"send": {"request": "drop"}, "recv": {"request": "drop"}},
    # the completion's recorded status (RUNNING: not finished) is the scheduler's own word
    status_proves=frozenset({"send", "recv"}),
)

"""repeated_preemption: a request preempted LIMIT times or more (pdtrace's example rule, docs/writing-a-rule.md).

Each preemption gives all of the request's blocks back and, when it resumes, recomputes its KV: a request preempted
again and again is a pool too small for the running set (thrashing), not a bug of the scheduler.

Algorithm: the shared table `request_state` counts each request's `req_preempt` rows (`n_preempt`). A request with
LIMIT or more is reported once, at its LIMIT-th preemption, citing its first LIMIT preemptions and its `req_add`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pdtrace.analysis.ruleapi import AnalysisContext, Cited, FindingsBuilder, Rule, columns, request_state

#: preemptions of one request that make a finding
LIMIT = 3


def run(ctx: AnalysisContext) -> pd.DataFrame:
    found = FindingsBuilder(ctx, "repeated_preemption")
    st = request_state(ctx)  # one row per request key (rk), built once for every rule that reads it
    often = np.flatnonzero(st.n_preempt >= LIMIT)
    if len(often) == 0:
        return found.frame()
    cols = columns(ctx)
    rows = cols.req_rows("req_preempt")
    rows = rows[np.isin(cols.rk[rows], often)]
    rows = rows[np.argsort(cols.pos[rows], kind="stable")]  # time order (`pos`: the global order)
    for rk in often.tolist():  # whole-column work above; a loop over the findings only
        mine = rows[cols.rk[rows] == rk][:LIMIT].tolist()
        cite: list[Cited] = [(row, f"preemption {i + 1}") for i, row in enumerate(mine)]
        if st.add_pos[rk] >= 0:
            cite.append((int(cols.order[st.add_pos[rk]]), "added here"))
        req = found.ref(mine[-1]).get("req")
        # at=: the finding's time, step, instance and request are those of its LIMIT-th preemption
        found.add("thrash", "warning",
                  f"{req} was preempted {int(st.n_preempt[rk])} times: each time it gave up its blocks and "
                  "recomputed its KV (the KV pool is too small for the running set)",
                  cite, at=mine[-1], extra={"preemptions": int(st.n_preempt[rk])})
    return found.frame()


RULE = Rule(
    id="repeated_preemption",
    summary="a request preempted again and again (the KV pool is too small for the running set)",
    run=run,
    subrules=("thrash",),
    needs=(request_state,),
    cost=0.01,
    # on a trace that starts mid-run, preemptions before the window are not counted: the count is a lower bound,
    # so a finding stands whatever came before
    window_policy={"thrash": {"request": "keep"}},
)

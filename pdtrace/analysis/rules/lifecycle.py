"""lifecycle: any event vLLM's KV lifecycle forbids, and any state that never resolves, named or not.

The rule reports the violations of `pdtrace.analysis.lifecycle` (the model replayed over every event; its module
docstring states the algorithm, docs/lifecycle.md the transitions and invariants with their vLLM sources). Subrule
= the invariant. Severity: `error` where vLLM itself asserts the invariant, `warning` otherwise (`INVARIANTS`).

It is a fallback rule (`Rule.fallback`): a violation that another rule explains (a finding at warning or error of
another rule on the same instance, dp_rank and request, or one citing the same event) is reported once, by that rule,
with its words. What is left
is what no rule claims: a class nobody described yet still reaches the report.

Evidence: the event, the request's history up to it (its add, allocations, waits, preemptions, finish, frees,
completions: the first rows and the latest) and, for a block, its allocation by the request that still held it; `extra.state` is the
request's (or block's) state before the event. On a scheduler whose engine failed, a state left open by the
failure is the crash's consequence (`rulekit.engine_failures`): info, as for the other absence-based rules.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from pdtrace.analysis.ruleapi import CRASH_NOTE, INVARIANTS, FindingsBuilder, Rule, engine_failures, lifecycle_model

#: history rows cited per finding (the rest are in `pdtrace show --req`)
HISTORY_CITED = 10
#: invariants that report a state left open at the end of the trace (an engine failure explains them)
_OPEN_AT_END = ("completion_not_processed", "ranks_disagree", "admission_stall")


def run(ctx: Any) -> pd.DataFrame:
    model = lifecycle_model(ctx)
    found = FindingsBuilder(ctx, "lifecycle")
    if not model.violations:
        return found.frame()
    found.refs([r for v in model.violations for r in [v.row, *v.history]])
    failures = engine_failures(ctx)
    names = found.cols.rk_names
    for v in model.violations:
        severity, meaning = INVARIANTS[v.invariant]
        req = str(names["req"].iloc[v.rk]) if v.rk >= 0 else None
        what = found.ref(v.row).get("kind")
        # the model's violations are a shared table: read, never changed (a context analysed again gets the same)
        extra = {key: value for key, value in v.extra.items() if key != "owner_rk"}
        extra.update(state=v.state, invariant=v.invariant)
        owner = str(names["req"].iloc[int(v.extra["owner_rk"])]) if "owner_rk" in v.extra else None
        if owner is not None:
            extra["owner"] = owner
        record = found.add(
            v.invariant, severity, f"{what} of {req or 'the scheduler'}: {meaning}; state before it: {v.state}",
            [(v.row, "the event the state forbids" if v.invariant not in _OPEN_AT_END
              else "the last event of the state left open")]
            + [(r, "history") for r in v.history if r != v.row][:HISTORY_CITED],
            sk=v.sk, req=req, blocks=v.blocks, extra=extra, requests=None if owner is None else [owner])
        failure = failures.get(v.sk)
        if failure is not None and v.invariant in _OPEN_AT_END:
            failure.mark(record, "the state could resolve")
            record["evidence"].append((failure.row, CRASH_NOTE))
    return found.frame()


RULE = Rule(
    id="lifecycle",
    summary="an event the KV lifecycle model forbids, or a state that never resolves, that no other rule explains",
    run=run,
    subrules=tuple(INVARIANTS),
    needs=(lifecycle_model,),
    cost=0.01,
    fallback=True,
)

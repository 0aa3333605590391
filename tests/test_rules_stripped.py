"""The stripped-field property: every rule gives the same findings when the optional fields and kinds the other
events already imply are removed (tests/stripped.py), or a weaker one that says why (`extra.downgraded`), except
where the stripped part was the only evidence (EXCEPTIONS, each with its reason; the rule then says so itself where
it can). Checked on every sample trace and every scenario of tests/scenarios*.py with everything stripped, and by
hypothesis on random subsets of the parts."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scenarios
import scenarios_pipeline
import scenarios_reuse
from stripped import PARTS, strip
from pdtrace.analysis import analyze
from pdtrace.trace.model import Trace
from pdtrace.trace.reader import open_trace

#: (not `from conftest import`: a subfolder's conftest.py, tests/real_engine's or tests/vllm_tier's, may be
#: `conftest` by the time this module is imported)
SAMPLE_TRACES = Path(__file__).resolve().parents[1] / "sample_traces"

SEVERITY = {"info": 0, "warning": 1, "error": 2}

# (stripped part, rule, subrule or None for any) -> why the finding may be lost or gained without that part
EXCEPTIONS: dict[tuple[str, str, str | None], str] = {
    ("worker", "pipeline_bubble", None):
        "bubbles are measured on the workers' exec spans; without them pipeline_bubble reports `not_measured`",
    ("engine_config", "pipeline_bubble", "not_measured"):
        "without the engine's config, an engine with several steps in flight (async scheduling) may be a pipeline: "
        "with no exec spans recorded, its bubbles are reported as not measured (info), not guessed",
    ("worker", "premature_free", "quorum"):
        "the per-rank reports (kv_*_rank) are worker rows: nothing else says a completion came before a rank",
    ("worker", "unscheduled_request", "dropped_from_batch"): "batch_add / batch_remove are worker rows",
    ("worker", "use_after_free", "remote_read"): "remote_read is a connector row",
    ("worker", "use_after_free", "transfer_after_reuse"):
        "the late transfer's per-rank reports (kv_*_rank) are worker rows: without them only its aggregated "
        "completion is seen (double_free's completion_after_free after a final free)",
    ("remote_read", "use_after_free", "remote_read"): "the peer's read is the finding's only evidence",
    ("trim", "premature_free", "async_load_reuse"):
        "a sliding-window trim handed to an asynchronous load under a step in flight: only the trim's window and "
        "token counts say whether that step still reads the blocks; without them the rule reports a warning that "
        "says so (`downgraded` = no_trim_window) on healthy trims too",
    ("worker", "lifecycle", "completion_not_processed"):
        "a transfer every rank reported that the scheduler never processed: the ranks' reports (kv_*_rank) are worker "
        "rows, the only evidence of it",
    ("worker", "lifecycle", "ranks_disagree"): "the ranks' reports (kv_*_rank) are worker rows",
    ("worker", "lifecycle", "read_before_filled"):
        "a store's per-rank reports (kv_send_rank) during the load are worker rows; its aggregated completion, where "
        "recorded, is completion_before_finish's",
    ("engine_config", "lifecycle", "admission_stall"):
        "a stall needs the pool's size (engine_config n) to say most of the KV cache is free",
    ("status", "double_free", "unknown_id"):
        "a completion for an id the trace never saw: only its status said the scheduler knows it; without one the "
        "rule reports a warning that says so (`downgraded` = no_status)",
}


def traces() -> dict[str, Callable[[], Trace]]:
    out: dict[str, Callable[[], Trace]] = {}
    for path in sorted(SAMPLE_TRACES.glob("*/trace")):
        out[f"sample:{path.parent.name}"] = (lambda p=path: open_trace(p))
    out.update({f"scenario:{k}": v for k, v in scenarios.HEALTHY.items()})
    out.update({f"faulty:{k}": v for k, v in scenarios.FAULTY.items()})
    out.update({f"pipeline:{k}": getattr(scenarios_pipeline, k) for k in dir(scenarios_pipeline)
                if k.endswith("_pp4")})
    out.update({f"reuse:{k}": v for k, v in {**scenarios_reuse.FAULTY, **scenarios_reuse.HEALTHY}.items()})
    out.update({f"random:{s}": (lambda s=s: scenarios.random_healthy(s)) for s in range(3)})
    return out


TRACES = traces()


@lru_cache(maxsize=None)
def table_of(name: str) -> Any:
    return TRACES[name]().table


@lru_cache(maxsize=None)
def findings_of(name: str, parts: frozenset[str]) -> pd.DataFrame:
    table = table_of(name)
    return analyze(Trace.from_table(strip(table, parts) if parts else table))


def _key(rec: dict[str, Any]) -> tuple:
    return (rec["rule"], rec["subrule"], rec["severity"], str(rec["req"]), tuple(rec["blocks"] or ()))


def _excepted(parts: frozenset[str], rule: str, subrule: str) -> str | None:
    for (part, r, sub), why in EXCEPTIONS.items():
        if part in parts and r == rule and sub in (None, subrule):
            return why
    return None


def differences(base: pd.DataFrame, got: pd.DataFrame, parts: frozenset[str]) -> list[str]:
    """What the stripped findings `got` do differently from `base` that neither a named exception nor a downgrade
    that says why accounts for."""
    base_recs = {_key(r): r for r in base.to_dict("records")}
    got_recs = {_key(r): r for r in got.to_dict("records")}
    lost = Counter(_key(r) for r in base.to_dict("records")) - Counter(_key(r) for r in got.to_dict("records"))
    gained = Counter(_key(r) for r in got.to_dict("records")) - Counter(_key(r) for r in base.to_dict("records"))
    problems = []
    for k in list(lost.elements()):
        rule, subrule, severity, req, blocks = k
        if _excepted(parts, rule, subrule):
            continue
        weaker = [g for g in gained.elements() if g[0] == rule and g[3] == req and g[4] == blocks
                  and SEVERITY[g[2]] <= SEVERITY[severity] and (got_recs[g].get("extra") or {}).get("downgraded")]
        if weaker:
            gained[weaker[0]] -= 1
            continue
        problems.append(f"lost {k}: {base_recs[k]['message']}")
    for k in gained.elements():
        rule, subrule, severity, req, blocks = k
        if _excepted(parts, rule, subrule):
            continue
        if severity != "error" and (got_recs[k].get("extra") or {}).get("downgraded") and \
                any(b[0] == rule and b[3] == req for b in base_recs):
            continue  # a weaker finding for the same request, saying why
        problems.append(f"gained {k}: {got_recs[k]['message']}")
    return problems


@pytest.mark.parametrize("name", sorted(TRACES))
def test_stripping_every_optional_part_keeps_the_findings(name: str) -> None:
    everything = frozenset(PARTS)
    assert differences(findings_of(name, frozenset()), findings_of(name, everything), everything) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(TRACES)), parts=st.sets(st.sampled_from(PARTS), min_size=1))
def test_stripping_any_subset_keeps_the_findings(name: str, parts: set[str]) -> None:
    chosen = frozenset(parts)
    assert differences(findings_of(name, frozenset()), findings_of(name, chosen), chosen) == []


def test_strip_removes_what_it_says() -> None:
    events = strip(table_of("sample:duplicate_completion_tp2")).to_pandas()
    kinds = set(events["kind"].astype(str))
    assert not kinds & {"engine_config", "exec_begin", "exec_end", "kv_send_rank", "kv_recv_rank", "batch_add",
                        "batch_remove", "remote_read"}
    assert {"kv_send_done", "kv_recv_done", "req_finish", "blocks_free"} <= kinds
    done = events[events["kind"].astype(str).isin(["kv_send_done", "kv_recv_done"])]
    assert len(done) and done["status"].isna().all()
    assert not done["detail"].fillna("").str.contains("expected_ranks").any()
    remote = events[(events["kind"].astype(str) == "req_finish")]
    assert remote["delay_free"].isna().any()


def test_no_worker_rows_say_bubbles_are_not_measured() -> None:
    got = findings_of("pipeline:healthy_pp4", frozenset({"worker"}))
    assert list(zip(got["rule"], got["subrule"], got["severity"])) == [("pipeline_bubble", "not_measured", "info")]
    assert "cannot be measured" in got.iloc[0]["message"]
    assert (findings_of("pipeline:healthy_pp4", frozenset())["subrule"] != "not_measured").all()


def test_no_engine_config_downgrades_starvation_and_says_why() -> None:
    base = findings_of("sample:starve", frozenset())
    got = findings_of("sample:starve", frozenset({"engine_config"}))
    starved = got[got["subrule"] == "starved"]
    assert len(starved) and (starved["severity"] == "warning").all()
    assert all(e.get("downgraded") == "no_engine_config" for e in starved["extra"])
    assert starved["message"].str.contains("no engine_config").all()
    assert (base[base["subrule"] == "starved"]["severity"] == "error").any()


def test_status_free_completions_on_healthy_decode_are_clean() -> None:
    # item 1's cause: without status, the history took the kv_recv_done as the end of the receive it completes
    for name in ("scenario:decode", "scenario:pd", "sample:healthy_pd_pp1", "sample:abort_while_waiting_kv"):
        got = findings_of(name, frozenset({"status"}))
        assert not (got["severity"] == "error").any(), name


def test_a_completion_the_trace_never_saw_needs_its_status() -> None:
    # vLLM 0.33's test_delayed_kv_connector_free_keeps_scheduler_active puts a finished request into
    # scheduler.requests by hand: its kv_send_done (status FINISHED_STOPPED) is the only event of that id
    from pdtrace.trace.builder import EventBuilder

    b = EventBuilder(instance="e", start_ns=scenarios.START_NS)
    b.add("req_add", req="queued", n=10)
    b.add("step_output", component="engine")
    b.add("kv_send_done", req="finished", status="FINISHED_STOPPED")
    assert len(analyze(b.trace())) == 0
    got = analyze(Trace.from_table(strip(b.table(), ["status"])))
    assert list(zip(got["subrule"], got["severity"])) == [("unknown_id", "warning")]
    assert got.iloc[0]["extra"]["downgraded"] == "no_status" and "may predate the recording" in got.iloc[0]["message"]
    assert _excepted(frozenset({"status"}), "double_free", "unknown_id")

"""Findings name the requests their evidence lies in (issue 22, item 4): `req` for the main one, the others in the
additive `requests` column, shown by the JSON and the terminal reports. no_progress/livelock said "447 preemptions
of 3 requests" and named none of them, so `pdtrace show --req` could not follow it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import scenarios
import scenarios_pipeline
import scenarios_preemption
import scenarios_reuse
from pdtrace.analysis import analyze, checked_findings
from pdtrace.analysis.findings import FINDING_COLUMNS, findings_frame
from pdtrace.analysis.registry import Rule
from pdtrace.trace.builder import write_table
from pdtrace.trace.reader import open_trace

#: (not `from conftest import`: a subfolder's conftest.py, tests/real_engine's or tests/vllm_tier's, may be
#: `conftest` by the time this module is imported)
REPO = Path(__file__).resolve().parents[1]
SAMPLE_TRACES = REPO / "sample_traces"


def _traces() -> dict:
    out = {f"sample:{p.parent.name}": (lambda p=p: open_trace(p)) for p in sorted(SAMPLE_TRACES.glob("*/trace"))}
    out.update({f"scenario:{k}": v for k, v in scenarios.HEALTHY.items()})
    out.update({f"faulty:{k}": v for k, v in scenarios.FAULTY.items()})
    out.update({f"preemption:{k}": v for k, v in scenarios_preemption.all_scenarios().items()})
    out.update({f"pipeline:{k}": getattr(scenarios_pipeline, k) for k in dir(scenarios_pipeline)
                if k.endswith("_pp4")})
    out.update({"reuse:late_load_into_reused_blocks": scenarios_reuse.double_load,
                "reuse:preempted_finished_by_older_step": scenarios_reuse.preempted_then_finished})
    return out


TRACES = _traces()


@pytest.mark.parametrize("name", sorted(TRACES))
def test_every_request_in_a_findings_evidence_is_named(name):
    for rec in analyze(TRACES[name]()).to_dict("records"):
        named = {rec["req"], *rec["requests"]}
        cited = {ev["req"] for ev in rec["evidence"] if ev.get("req") is not None
                 and ev.get("instance", rec["instance"]) == rec["instance"]}
        assert cited <= named, (rec["rule"], rec["subrule"], rec["message"])
        assert rec["req"] not in rec["requests"]


def test_the_livelock_names_its_victims_and_the_reports_show_them(tmp_path: Path):
    """As users run it (a `pdtrace` process): the JSON finding has `req` and `requests`, the terminal header line
    lists them."""
    trace_dir = write_table(scenarios_preemption.deferred_free_cascade(cycles=20).table, tmp_path / "cascade")
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    run = [sys.executable, "-m", "pdtrace", "analyze", str(trace_dir), "--fail-on", "never"]
    doc = json.loads(subprocess.run(run + ["--format", "json"], capture_output=True, text=True, env=env,
                                    check=True).stdout)
    (livelock,) = [f for f in doc["findings"] if f["rule"] == "no_progress"]
    assert livelock["req"] == "a" and livelock["requests"] == ["b", "c"]
    assert all(isinstance(f["requests"], list) for f in doc["findings"])
    text = subprocess.run(run, capture_output=True, text=True, env=env, check=True).stdout
    header = next(line for line in text.splitlines() if "no_progress/livelock" in line)
    assert "req a" in header and "(and reqs b, c)" in header


def test_a_rule_without_the_requests_column_still_loads():
    """A plugin written before the column: its findings are kept, `requests` derived from their evidence."""
    rec = {c: None for c in FINDING_COLUMNS if c != "requests"}
    rec.update(rule="mine", subrule="x", severity="warning", instance="E", req="r1", blocks=[], extra={},
               evidence=[{"kind": "req_sched", "req": "r1"}, {"kind": "req_sched", "req": "r2", "instance": "E"},
                         {"kind": "req_add", "req": "p1", "instance": "P"}])
    frame = pd.DataFrame([rec])
    got = checked_findings(frame, Rule(id="mine", summary="", run=lambda ctx: frame))
    assert list(got.columns) == list(FINDING_COLUMNS)
    assert got.iloc[0]["requests"] == ["r2"]  # another instance's request is not this instance's id
    explicit = findings_frame([dict(rec, requests=["r9"])])
    assert checked_findings(explicit, Rule(id="mine", summary="", run=lambda ctx: explicit)).iloc[0]["requests"] \
        == ["r9"]

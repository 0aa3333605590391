"""A third-party rule declares its behaviour on its `Rule` exactly as the built-ins do, and the engine honours it.

A tiny rule (`toy`) lives in a package written under tmp_path, registered through a `*.dist-info/entry_points.txt`
in the `pdtrace.rules` group and found by `importlib.metadata` (tmp_path on sys.path; nothing installed). It has
three subrules, each needing one declaration:
- `orphan_free` (a free of a request the trace never added): `window_policy` {"request": "drop"}. On a cut after
  the request's req_add the free is no orphan: the add lies before the window. Dropped; undeclared, it would be
  downgraded, not dropped.
- `events` (one finding per instance counting the rows analysed): `per_window`. A windowed analysis reports each
  window's count, marked `extra.windowed` with the declared reason; undeclared, nothing is marked.
- `peer_unknown` (a remote_read naming a request its owner instance never added): `cross_instance`. A partition
  holds the reader without the owner, so phase 1 reports every read; the declared link re-runs the rule on reader
  and owner together, as the whole trace does. Undeclared, the partitioned analysis reports a false error.
Each test runs the declared rule and the same rule with the declaration removed (`dataclasses.replace`), and
asserts the outcomes differ where the declaration matters.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from scenarios import Engine, builder
from pdtrace.analysis import AnalysisConfig, analyze
from pdtrace.analysis.registry import load_rules
from pdtrace.trace.model import Trace

S = 1_000_000_000
WHY = "toy: counts the rows of the analysed span"

TOY_RULE = textwrap.dedent('''
    """A toy pdtrace rule, registered through the entry point like any third-party rule."""
    import json

    import pandas as pd

    from pdtrace.analysis.findings import findings_frame
    from pdtrace.analysis.registry import CrossInstance, Rule


    def _rows(ctx):
        return ctx.trace.table.select(["kind", "instance", "req", "ts_ns", "seq", "detail"]).to_pylist()


    def run(ctx):
        rows = _rows(ctx)
        added = {(r["instance"], r["req"]) for r in rows if r["kind"] == "req_add"}
        out = []
        for r in rows:
            ref = {"kind": r["kind"], "ts_ns": r["ts_ns"], "seq": r["seq"], "instance": r["instance"], "req": r["req"]}
            if r["kind"] == "blocks_free" and r["req"] is not None and (r["instance"], r["req"]) not in added:
                out.append({"rule": "toy", "subrule": "orphan_free", "severity": "error", "instance": r["instance"],
                            "req": r["req"], "ts_ns": r["ts_ns"], "message": "free of a request never added",
                            "evidence": [ref], "context": "toy:orphan_free", "extra": {}})
            if r["kind"] == "remote_read":
                detail = json.loads(r["detail"] or "{}")
                owner = (detail.get("remote_instance"), detail.get("remote_req"))
                if owner not in added:
                    out.append({"rule": "toy", "subrule": "peer_unknown", "severity": "error",
                                "instance": r["instance"], "req": r["req"], "ts_ns": r["ts_ns"],
                                "message": f"read of {owner[1]} that {owner[0]} never added", "evidence": [ref],
                                "context": "toy:peer_unknown", "extra": {"owner": list(owner)}})
        per_instance = {}
        for r in rows:
            if r["kind"] != "engine_config":
                per_instance.setdefault(r["instance"], []).append(r["ts_ns"])
        for instance, ts in sorted(per_instance.items()):
            out.append({"rule": "toy", "subrule": "events", "severity": "info", "instance": instance,
                        "ts_ns": max(ts), "message": f"{len(ts)} events", "evidence": [], "context": "toy:events",
                        "extra": {"events": len(ts)}})
        return findings_frame(out)


    def summarize(ctx, findings, instances):
        named = findings[findings["subrule"] == "peer_unknown"]["extra"] if len(findings) else []
        return tuple(sorted({e["owner"][0] for e in named} - set(instances)))


    def merge(parts):
        return tuple(sorted({name for part in parts for name in part}))


    def links(parts):
        owner_of = {inst: i for i, (instances, _) in enumerate(parts) for inst in instances}
        return {(i, owner_of[n]) for i, (_, part) in enumerate(parts) for n in (part or ()) if n in owner_of}


    RULE = Rule(
        id="toy", summary="a toy rule", run=run, subrules=("orphan_free", "peer_unknown", "events"),
        window_policy={"orphan_free": {"request": "drop"}},
        per_window=%r,
        cross_instance=CrossInstance("peer_unknown", summarize, merge, links),
    )
''') % WHY


@pytest.fixture()
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The toy rule, registered through the `pdtrace.rules` entry point of a distribution under tmp_path."""
    (tmp_path / "pdtrace_toy_rule.py").write_text(TOY_RULE)
    info = tmp_path / "pdtrace_toy_rule-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pdtrace-toy-rule\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pdtrace.rules]\ntoy = pdtrace_toy_rule:RULE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pdtrace_toy_rule", raising=False)
    rule = load_rules()["toy"]
    assert rule.per_window == WHY and rule.cross_instance is not None
    return rule


def trace() -> Trace:
    """P adds and frees r1 (allocated, scheduled, finished); D adds d1 and reads P's r1 (known to P) and P's ghost
    (never added anywhere): only the ghost read is wrong."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("r1", n=32, remote_decode=True)
    for _ in range(6):
        p.step({"r1": 4}, alloc={"r1": [5, 6]} if _ == 0 else None)
        p.output()
    d.add("d1", n=32)
    for remote_req in ("r1", "ghost"):
        b.add("remote_read", instance="D", role="decode", pid=2000, component="connector", req="d1",
              blocks=[5, 6], detail={"remote_instance": "P", "remote_req": remote_req})
    for _ in range(6):
        d.step({"d1": 1})
        d.output()
    b.advance(S)
    p.free("r1", [5, 6])
    p.step({})
    p.output()
    return b.trace()


def _ids(frame: pd.DataFrame) -> list[tuple[str, str, str, str]]:
    return sorted((r["subrule"], r["severity"], str(r["instance"]), str(r["req"])) for r in frame.to_dict("records")
                  if r["subrule"] != "events")


def _fresh() -> Trace:
    return Trace.from_table(trace().table)


def test_whole_trace(toy: Any) -> None:
    got = analyze(_fresh(), rules=["toy"], config=AnalysisConfig(jobs=1), partitioned=False)
    assert _ids(got) == [("peer_unknown", "error", "D", "d1")]
    assert json.dumps(sorted(got["message"])).count("ghost") == 1


def test_a_cut_drops_what_the_window_policy_says(toy: Any) -> None:
    t = _fresh()
    ts = t.table.column("ts_ns").to_pylist()
    kinds = t.table.column("kind").cast("string").to_pylist()
    cut = max(ts[i] for i, k in enumerate(kinds) if k == "req_add") + 1  # after every add, before the free
    got = analyze(t.cut(cut), rules=["toy"], config=AnalysisConfig(jobs=1), partitioned=False)
    assert ("orphan_free", "error", "P", "r1") not in _ids(got)
    assert not (got["subrule"] == "orphan_free").any()
    # the same rule without its declaration: the free's request began before the window, so it is downgraded
    bare = replace(toy, window_policy={})
    undeclared = analyze(_fresh().cut(cut), rules=[bare], config=AnalysisConfig(jobs=1), partitioned=False)
    assert ("orphan_free", "warning", "P", "r1") in _ids(undeclared)


def test_a_partitioned_trace_links_what_cross_instance_says(toy: Any) -> None:
    whole = analyze(_fresh(), rules=["toy"], config=AnalysisConfig(jobs=1), partitioned=False)
    parts = analyze(_fresh(), rules=["toy"], config=AnalysisConfig(jobs=1), partitioned=True)
    assert _ids(parts) == _ids(whole) == [("peer_unknown", "error", "D", "d1")]
    assert parts.attrs["partitions"] == ["P", "D"]
    # without the link, D's partition alone does not see P add r1: its read is reported too
    bare = replace(toy, cross_instance=None)
    undeclared = analyze(_fresh(), rules=[bare], config=AnalysisConfig(jobs=1), partitioned=True)
    assert _ids(undeclared) == [("peer_unknown", "error", "D", "d1")] * 2


def test_a_windowed_analysis_measures_per_window_what_per_window_says(toy: Any) -> None:
    # P alone (nothing of it links): its counts are measured per window
    config = AnalysisConfig(jobs=1, window_events=12, instances=("P",))
    got = analyze(_fresh(), rules=["toy"], config=config)
    windows = got.attrs["windows"]["P"]["windows"]
    counts = got[got["subrule"] == "events"]
    assert len(counts) == windows > 2, "P must have been analysed window by window"
    assert all(e["windowed"]["why"] == WHY for e in counts["extra"])
    assert all(m.startswith("window ") for m in counts["message"])
    # undeclared: each window's count is kept by the window holding its ts, unmarked
    undeclared = analyze(_fresh(), rules=[replace(toy, per_window=None)], config=config)
    assert not any("windowed" in (e or {}) for e in undeclared[undeclared["subrule"] == "events"]["extra"])


def test_a_windowed_analysis_links_its_windows_summaries(toy: Any) -> None:
    config = AnalysisConfig(jobs=1, window_events=12)
    got = analyze(_fresh(), rules=["toy"], config=config)
    assert set(got.attrs["windows"]) == {"P", "D"}, "both instances must have been analysed window by window"
    assert _ids(got) == [("peer_unknown", "error", "D", "d1")]  # D's windows' summaries merged, then linked
    assert not any("read of r1 " in m for m in got["message"])
    undeclared = analyze(_fresh(), rules=[replace(toy, cross_instance=None)], config=config)
    assert any("read of r1 " in m for m in undeclared["message"])  # the read P's rows explain, reported

"""The reporters render findings only: memcheck grouping, leak and bubble summaries, JSON-safe values."""

from __future__ import annotations

import io
import json

import numpy as np
import pandas as pd
from rich.console import Console

from pdtrace.analysis import summarize_findings
from pdtrace.analysis.findings import findings_frame
from pdtrace.report.json_report import findings_document, render_json
from pdtrace.report.terminal import render_terminal

T0 = 1_700_000_000_000_000_000


def finding(**kw):
    base = {"rule": "premature_free", "subrule": "send_open", "severity": "error", "instance": "P", "dp_rank": 0,
            "req": "r1", "blocks": [5, 6], "step": 3, "ts_ns": T0 + 2_000_000, "message": "blocks freed early",
            "evidence": [{"kind": "blocks_free", "ts_ns": T0 + 2_000_000, "seq": 12, "req": "r1", "step": 3,
                          "instance": "P", "blocks": [5, 6], "note": "blocks given up here"},
                         {"kind": "blocks_alloc", "ts_ns": T0 + 1_000, "seq": 2, "req": "r1", "step": 0,
                          "instance": "P", "note": "allocated here"}],
            "context": "premature_free:send_open:aborted", "extra": {}}
    base.update(kw)
    return base


def render(df, **kw) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=160, color_system=None)
    render_terminal(df, summarize_findings(df), console, trace="T", start_ns=T0, **kw)
    return buf.getvalue()


def test_contexts_group_findings_like_memcheck():
    df = findings_frame([finding(req=f"r{i}", ts_ns=T0 + i) for i in range(8)]
                        + [finding(rule="double_free", subrule="not_owned", context="double_free:not_owned")]
                        + [finding(severity="warning", context="w")])
    text = render(df)
    assert "ERROR SUMMARY: 9 errors from 2 contexts (warnings: 1, info: 0)" in text
    assert "(8 in this context)" in text
    assert text.count("also:") == 5 + 0            # five one-liners, the rest counted
    assert "... and 2 more in this context" in text
    # the first finding of a context is in full, with its evidence in order and relative times
    free_at = text.index("blocks given up here: blocks_free")
    alloc_at = text.index("allocated here: blocks_alloc")
    assert free_at < alloc_at
    assert "+0.002000 s" in text and "seq 12" in text and "blocks [5, 6]" in text
    assert text.index("ERROR premature_free/send_open") < text.index("WARNING premature_free/send_open")
    full = render(df, verbose=True)
    assert "also:" not in full and full.count("blocks given up here") == 10


def test_leak_summary_counts_blocks_per_instance_and_pool_share():
    leaks = [finding(rule="leaked_blocks", subrule="definitely", instance="P", blocks=[1, 2, 3],
                     extra={"class": "definitely", "n_blocks": 3, "pool_blocks": 100}, context="l1"),
             finding(rule="leaked_blocks", subrule="indirectly", instance="P", blocks=[4],
                     extra={"class": "indirectly", "n_blocks": 1, "pool_blocks": 100}, context="l2"),
             finding(rule="leaked_blocks", subrule="possibly", severity="warning", instance="D", blocks=[9, 10],
                     extra={"class": "possibly", "n_blocks": 2}, context="l3")]
    df = findings_frame(leaks)
    summary = summarize_findings(df)
    by_inst = {row["instance"]: row for row in summary["leaks"]}
    assert by_inst["P"]["blocks"] == 4 and by_inst["P"]["definitely"] == 3 and by_inst["P"]["indirectly"] == 1
    assert by_inst["P"]["pool_percent"] == 4.0 and by_inst["P"]["requests"] == 2
    assert by_inst["D"]["possibly"] == 2 and by_inst["D"]["pool_percent"] is None
    text = render(df)
    assert "LEAK SUMMARY" in text and "4.0%" in text


def test_bubble_summary_per_rank():
    bubbles = [finding(rule="pipeline_bubble", subrule="queue_not_full", severity="warning", req=None, blocks=[],
                       instance="E", extra={"p": 4, "pp_rank": r, "idle_fraction": 0.25 * r, "lost_fraction": 0.1,
                                            "avoidable_fraction": 0.05}, context="b") for r in range(4)]
    df = findings_frame(bubbles)
    summary = summarize_findings(df)
    assert [b["pp_rank"] for b in summary["bubbles"]] == [0, 1, 2, 3]
    text = render(df)
    assert "BUBBLE SUMMARY" in text and "3/4" in text and "75.0%" in text and "queue_not_full" in text


def test_empty_findings_render_clean():
    df = findings_frame([])
    text = render(df)
    assert "ERROR SUMMARY: 0 errors from 0 contexts" in text
    doc = json.loads(render_json(df, summarize_findings(df), "T"))
    assert doc["findings"] == [] and doc["summary"]["errors"] == 0


def test_json_converts_numpy_and_missing_values():
    df = findings_frame([finding(dp_rank=np.int16(2), step=np.int64(7), ts_ns=np.int64(T0), blocks=np.array([1, 2]),
                                 extra={"held_s": np.float64(1.5), "nan": float("nan"), "na": pd.NA})])
    doc = findings_document(df, summarize_findings(df), "T")
    f = doc["findings"][0]
    assert f["dp_rank"] == 2 and f["step"] == 7 and f["ts_ns"] == T0 and f["blocks"] == [1, 2]
    assert f["extra"] == {"held_s": 1.5, "nan": None, "na": None}
    json.dumps(doc)   # serialisable as is

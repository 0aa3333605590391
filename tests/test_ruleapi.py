"""The rule author's surface (`pdtrace.analysis.ruleapi`, docs/writing-a-rule.md): every built-in rule imports from
pdtrace only that module; it exports nothing private and sits below the rules; the findings builder fills a
finding's fields from the rows it cites; the doc's example rule is real code, registered through the entry point,
that fires on a thrashing request and stays silent on its healthy twin; the old import paths still work."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from scenarios import Engine, builder, preempt_resume
from test_import_graph import import_graph
from pdtrace.analysis import analyze
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.registry import load_rules
from pdtrace.trace.model import Trace

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "pdtrace" / "analysis" / "rules"
EXAMPLE = REPO / "examples" / "rules" / "pdtrace_repeated_preemption.py"
DOC = REPO / "docs" / "writing-a-rule.md"

SURFACE = "pdtrace.analysis.ruleapi"
#: what a rule may import besides the surface
ALLOWED_THIRD_PARTY = {"numpy", "pandas"}


def foreign_imports(source: str) -> list[str]:
    """The imports of a rule module's source (at every level, inside functions too) that are neither the rule API,
    the standard library, numpy nor pandas."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if name == SURFACE or name == "__future__":
                continue
            if name.startswith(".") or top == "pdtrace" or (top not in sys.stdlib_module_names
                                                            and top not in ALLOWED_THIRD_PARTY):
                out.append(name)
    return out


def private_names(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("_")]


@pytest.mark.parametrize("path", sorted(p for p in RULES.glob("*.py") if p.name != "__init__.py") + [EXAMPLE],
                         ids=lambda p: p.stem)
def test_a_rule_imports_from_pdtrace_only_the_rule_api(path: Path) -> None:
    source = path.read_text()
    assert foreign_imports(source) == [], f"{path.name} imports outside {SURFACE}"
    assert f"from {SURFACE} import" in source


def test_the_import_check_names_what_a_rule_must_not_import() -> None:
    source = ("import numpy as np\nimport pyarrow as pa\nfrom pdtrace.analysis.steps import _step_frame\n"
              "from pdtrace.analysis.ruleapi import Rule\n"
              "def run(ctx):\n    from pdtrace.analysis.rules.premature_free import last_sched_before\n"
              "    from . import sibling\n    import json\n")
    assert foreign_imports(source) == ["pyarrow", "pdtrace.analysis.steps", "pdtrace.analysis.rules.premature_free",
                                       "."]


def test_the_rule_api_exports_its_names_and_nothing_private() -> None:
    import pdtrace.analysis.ruleapi as api

    assert private_names(list(api.__all__)) == []
    assert private_names(["Rule", "_step_frame"]) == ["_step_frame"]  # the check fires
    missing = [n for n in api.__all__ if not hasattr(api, n)]
    assert missing == []
    # what the module binds is what it exports (a name imported for its own use would leak into the surface)
    bound = {n for n, v in vars(api).items() if not n.startswith("_") and type(v).__name__ != "module"}
    assert bound - {"annotations"} == set(api.__all__)
    assert len(api.__all__) == len(set(api.__all__))


def test_the_rule_api_sits_above_what_it_exports_and_below_the_rules() -> None:
    graph = import_graph()
    seen, todo = set(), [SURFACE]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    assert SURFACE not in seen
    assert not [m for m in seen if m.startswith("pdtrace.analysis.rules")]
    assert {"pdtrace.analysis.requests", "pdtrace.analysis.rulekit", "pdtrace.analysis.lifecycle"} <= seen
    users = sorted(m for m, deps in graph.items() if SURFACE in deps)
    assert users and all(m.startswith("pdtrace.analysis.rules.") for m in users)


def test_old_import_paths_keep_working() -> None:
    from pdtrace.analysis import requests, steps
    from pdtrace.analysis.rules.premature_free import last_sched_before
    from pdtrace.analysis.steps import _step_frame

    assert last_sched_before is requests.last_sched_before
    assert _step_frame is steps.step_frame


# --- the findings builder ---------------------------------------------------------------------------------------

def _ctx() -> AnalysisContext:
    return AnalysisContext(preempt_resume())


def test_the_builder_fills_a_finding_from_the_row_it_cites() -> None:
    from pdtrace.analysis.ruleapi import FindingsBuilder, columns

    ctx = _ctx()
    cols = columns(ctx)
    preempt = int(cols.rows_of("req_preempt")[0])
    free = int(cols.rows_of("blocks_free")[0])
    found = FindingsBuilder(ctx, "toy")
    record = found.add("sub", "warning", "b was preempted", [(preempt, "here"), free])
    record["evidence"].append((free, "appended before the frame is built"))
    frame = found.frame()
    row = frame.iloc[0].to_dict()
    assert (row["rule"], row["subrule"], row["severity"], row["message"]) == ("toy", "sub", "warning",
                                                                              "b was preempted")
    assert (row["instance"], row["dp_rank"], row["req"], row["step"]) == ("E", 0, "b", 1)
    assert row["ts_ns"] == int(cols.ts[preempt])
    # `requests` left None: the engine derives it from the evidence (findings.named_requests)
    assert (row["blocks"], row["context"], row["extra"], row["requests"]) == ([], "toy:sub", {}, None)
    kinds = [(ev["kind"], ev.get("note")) for ev in row["evidence"]]
    assert kinds == [("req_preempt", "here"), ("blocks_free", None),
                     ("blocks_free", "appended before the frame is built")]
    assert row["evidence"][0]["seq"] is not None and row["evidence"][1]["blocks"] == [3, 4]


def test_the_builder_takes_when_from_at_and_who_from_about() -> None:
    from pdtrace.analysis.ruleapi import FindingsBuilder, columns

    ctx = _ctx()
    cols = columns(ctx)
    frees = cols.rows_of("blocks_free")
    a_free = int(frees[[r == "a" for r in cols.table.column("req").take(frees).to_pylist()]][0])
    b_add = int(cols.rows_of("req_add")[1])
    found = FindingsBuilder(ctx, "toy")
    found.add("sub", "error", "m", [(b_add, "b")], at=a_free, about=b_add, context="toy:sub:more",
              blocks=[1], extra={"k": 1}, requests=["a"])
    found.add("none", "info", "no row", sk=0, req=None, step=None, ts_ns=5)
    frame = found.frame()
    first, second = frame.iloc[0].to_dict(), frame.iloc[1].to_dict()
    assert first["ts_ns"] == int(cols.ts[a_free]) and first["step"] == int(cols.step[a_free])
    assert (first["req"], first["instance"], first["context"], first["blocks"], first["extra"],
            first["requests"]) == ("b", "E", "toy:sub:more", [1], {"k": 1}, ["a"])
    assert (second["instance"], second["dp_rank"], second["req"], second["step"], second["ts_ns"],
            second["evidence"]) == ("E", 0, None, None, 5, [])


def test_the_builder_refuses_a_finding_it_cannot_place() -> None:
    from pdtrace.analysis.ruleapi import FindingsBuilder

    found = FindingsBuilder(_ctx(), "toy")
    with pytest.raises(ValueError, match="cites no row"):
        found.add("sub", "info", "nowhere", [{"kind": "exec_end", "ts_ns": 1}])
    found.add("sub", "info", "placed", [{"kind": "exec_end", "ts_ns": 1}], instance="E", dp_rank=None, ts_ns=1)
    assert found.frame()["evidence"].iloc[0] == [{"kind": "exec_end", "ts_ns": 1}]


# --- the doc's example rule ---------------------------------------------------------------------------------------

def thrash(preemptions: int) -> Trace:
    """E runs a and b in a pool of 8 blocks; b is preempted `preemptions` times, rescheduled after each, and both
    finish."""
    b = builder()
    e = Engine(b, instance="E", role="both", num_blocks=8)
    e.add("a", n=32)
    e.add("b", n=32)
    e.step({"a": 32, "b": 32}, alloc={"a": [1, 2], "b": [3, 4]})
    e.output()
    for _ in range(preemptions):
        e.step({"a": 1}, preempt={"b": [3, 4]})
        e.output()
        e.step({"b": 32}, alloc={"b": [3, 4]})
        e.output()
    e.finish("a", reason="length")
    e.finish("b", reason="stop")
    return b.trace()


@pytest.fixture()
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The example rule, registered as the doc says: a distribution's `pdtrace.rules` entry point (a dist-info
    under tmp_path, found by importlib.metadata; the module on sys.path)."""
    info = tmp_path / "pdtrace_repeated_preemption-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pdtrace-repeated-preemption\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[pdtrace.rules]\nrepeated_preemption = pdtrace_repeated_preemption:RULE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    monkeypatch.delitem(sys.modules, "pdtrace_repeated_preemption", raising=False)
    return load_rules()["repeated_preemption"]


def test_the_doc_shows_the_example_rule_as_it_is() -> None:
    doc = DOC.read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in doc
    for text in ("pdtrace.rules", "window_policy", "per_window", "cross_instance", "FindingsBuilder"):
        assert text in doc


def test_the_example_rule_fires_on_a_thrashing_request(example) -> None:
    findings = analyze(thrash(3), rules=["repeated_preemption"])
    assert len(findings) == 1
    f = findings.iloc[0].to_dict()
    assert (f["rule"], f["subrule"], f["severity"], f["instance"], f["req"]) == (
        "repeated_preemption", "thrash", "warning", "E", "b")
    assert f["extra"] == {"preemptions": 3}
    assert [(ev["kind"], ev["note"]) for ev in f["evidence"]] == [
        ("req_preempt", "preemption 1"), ("req_preempt", "preemption 2"), ("req_preempt", "preemption 3"),
        ("req_add", "added here")]
    assert f["ts_ns"] == f["evidence"][2]["ts_ns"] and f["step"] == f["evidence"][2]["step"]


@pytest.mark.parametrize("healthy", [lambda: thrash(2), preempt_resume], ids=["two_preemptions", "preempt_resume"])
def test_the_example_rule_stays_silent_on_the_healthy_twin(example, healthy) -> None:
    assert len(analyze(healthy(), rules=["repeated_preemption"])) == 0

"""The shipped sample traces (core tier, no vLLM): `pdtrace analyze --format json` on each must report exactly the
findings its expected.json lists, compared on rule, subrule, severity, instance, finding count and request ids
(never timestamps or messages). Also checks the set is complete, documented and small.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLES_DIR = REPO / "sample_traces"
SIZE_LIMIT = 5 * 1024 * 1024

#: Every sample the dry-run issue asks for: the two healthy ones and one per fault.
#: abort_while_waiting_kv is a negative control: vLLM 0.33 keeps an aborted WAITING_FOR_REMOTE_KVS request's blocks
#: until its read completes (scheduler.py:3015-3024), so a correct analyzer reports nothing there.
NEGATIVE_CONTROLS = ("abort_while_waiting_kv",)
REQUIRED = ("healthy_pd_pp1", "healthy_pp4", "completion_before_finish", "lost_send_completion",
            "abort_while_waiting_kv", "duplicate_completion", "duplicate_completion_tp2", "missing_rank_completion",
            "slow_transfer", "starve", "few_requests_pp")


def summarize_findings(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group findings by (rule, subrule, severity, instance): how many, and which requests (sorted, distinct)."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for f in findings:
        key = (str(f.get("rule")), str(f.get("subrule") or ""), str(f.get("severity")), str(f.get("instance") or ""))
        groups[key].append(f)
    out = []
    for (rule, subrule, severity, instance), items in sorted(groups.items()):
        reqs = sorted({str(f["req"]) for f in items if f.get("req")})
        out.append({"rule": rule, "subrule": subrule, "severity": severity, "instance": instance,
                    "count": len(items), "reqs": reqs})
    return out


def sample_dirs() -> list[Path]:
    return sorted(p for p in SAMPLES_DIR.iterdir() if p.is_dir() and (p / "expected.json").exists())


def run_analyze(cli: Any, sample: Path, expected: dict[str, Any]) -> list[dict[str, Any]]:
    res = cli("analyze", sample / "trace", "--format", "json", "--fail-on", "never", *expected.get("analyze_args", []))
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)["findings"]


def test_every_required_sample_is_shipped() -> None:
    names = {p.name for p in sample_dirs()}
    missing = [n for n in REQUIRED if n not in names]
    assert not missing, f"samples without a trace/expected.json: {missing}"


@pytest.mark.parametrize("name", REQUIRED)
def test_sample_reports_its_expected_findings(cli: Any, name: str) -> None:
    sample = SAMPLES_DIR / name
    expected = json.loads((sample / "expected.json").read_text())
    got = summarize_findings(run_analyze(cli, sample, expected))
    assert got == expected["findings"]


@pytest.mark.parametrize("name", REQUIRED)
def test_sample_is_regenerable_and_documented(name: str) -> None:
    sample = SAMPLES_DIR / name
    regen = (sample / "REGENERATE").read_text()
    assert "pdtrace record --dry-run" in regen and f"sample_traces/{name}/trace" in regen
    manifest = json.loads((sample / "trace" / "_manifest.json").read_text())
    assert manifest["source"] == "dryrun" and manifest["dry_run"]["seed"] == json.loads(
        (sample / "expected.json").read_text())["config"]["seed"]
    assert f"`{name}`" in (SAMPLES_DIR / "README.md").read_text()
    # The release that made it, and the hook table: in the manifest, in every engine_config event, in REGENERATE.
    from pdtrace.recording.vllm import table_for

    release = manifest["vllm_version"]
    assert manifest["vllm_table"] == table_for(release).name and f"needs vLLM {release}" in regen
    import pyarrow.compute as pc

    from pdtrace import open_trace

    table = open_trace(sample / "trace").table
    details = table.filter(pc.equal(table["kind"].cast("string"), "engine_config"))["detail"].to_pylist()
    named = {(d["vllm_version"], d["table"]) for d in map(json.loads, details)}
    assert details and named == {(release, manifest["vllm_table"])}


def test_healthy_samples_have_no_errors_and_fault_samples_do() -> None:
    """The expectation files themselves: healthy runs are clean; each fault sample reports something."""
    for name in REQUIRED:
        expected = json.loads((SAMPLES_DIR / name / "expected.json").read_text())
        severities = {f["severity"] for f in expected["findings"]}
        if name.startswith("healthy") or name in NEGATIVE_CONTROLS:
            assert "error" not in severities and "warning" not in severities, name
        else:
            assert expected["findings"], f"{name}: a fault sample with no finding"


def test_samples_are_small() -> None:
    total = sum(p.stat().st_size for p in SAMPLES_DIR.rglob("*") if p.is_file())
    assert total <= SIZE_LIMIT, f"sample_traces/ holds {total / 1e6:.1f} MB (limit 5 MB)"


def test_summary_groups_and_counts() -> None:
    findings = [
        {"rule": "leaked_blocks", "subrule": "indirectly", "severity": "error", "instance": "p", "req": "b"},
        {"rule": "leaked_blocks", "subrule": "indirectly", "severity": "error", "instance": "p", "req": "a"},
        {"rule": "leaked_blocks", "subrule": "indirectly", "severity": "error", "instance": "p", "req": "a"},
        {"rule": "pipeline_bubble", "subrule": None, "severity": "info", "instance": "d", "req": None},
    ]
    assert summarize_findings(findings) == [
        {"rule": "leaked_blocks", "subrule": "indirectly", "severity": "error", "instance": "p", "count": 3,
         "reqs": ["a", "b"]},
        {"rule": "pipeline_bubble", "subrule": "", "severity": "info", "instance": "d", "count": 1, "reqs": []},
    ]

"""What users rely on after a real run, as assertions on the trace (read through pdtrace's CLI and reader)."""

from __future__ import annotations


import json
from pathlib import Path

import real_engines as R


def kinds(trace: Path):
    return R.events(trace)


def requests_of(ev, kind: str, instance: str | None = None) -> set[str]:
    rows = ev[ev["kind"] == kind]
    if instance is not None:
        rows = rows[rows["instance"].astype(str) == instance]
    return set(rows["req"].dropna().astype(str))


def assert_every_request_served(trace: Path, n: int, instance: str | None = None) -> None:
    """N of N requests added, scheduled, finished, and their blocks given back to the pool."""
    ev = R.events(trace)
    added = requests_of(ev, "req_add", instance)
    assert len(added) == n, f"{len(added)} req_add for {n} requests"
    assert requests_of(ev, "req_sched", instance) == added
    assert requests_of(ev, "req_finish", instance) == added
    assert requests_of(ev, "blocks_alloc", instance) == added
    assert requests_of(ev, "blocks_free", instance) == added
    sched = ev[ev["component"].astype(str) == "scheduler"]
    if instance is not None:
        sched = sched[sched["instance"].astype(str) == instance]
    allocated = _blocks(sched[sched["kind"] == "blocks_alloc"])
    freed = _blocks(sched[sched["kind"] == "blocks_free"])
    assert allocated == freed, "every (request, block) allocated is freed"


def _blocks(rows) -> set[tuple[str, int]]:
    return {(str(r), int(b)) for r, bl in zip(rows["req"], rows["blocks"], strict=True) if bl is not None for b in bl}


def assert_no_recorder_loss(trace: Path) -> None:
    doc = R.info(trace)
    assert doc["dropped_events"] == 0
    assert "recorder_off" not in doc["kinds"] and "recorder_gap" not in doc["kinds"], doc["kinds"]
    manifest = json.loads((trace / "_manifest.json").read_text())
    assert manifest.get("exit_status") == 0, manifest


def assert_healthy_findings(trace: Path, *args: str) -> dict:
    code, doc = R.analyze(trace, *args)
    bad = R.findings_at_least(doc)
    assert not bad, json.dumps(bad[:5], indent=1)[:4000]
    assert code == 0
    return doc


def assert_manifest_names_vllm(run: R.Run) -> None:
    manifest = json.loads((run.trace / "_manifest.json").read_text())
    release = R.release()
    assert manifest["vllm_version"] == release, (manifest, release)
    assert manifest["vllm_table"], manifest
    # pdtrace's own line (vLLM's log says "not installed" of Triton, so look for what pdtrace printed)
    assert f"pdtrace: vLLM {release}, hook table {manifest['vllm_table']}" in run.log, run.log[-2000:]
    assert "nothing is recorded" not in run.log


def assert_one_instance(trace: Path, pp_ranks: list[int], requests: int) -> None:
    """One instance: the scheduler's and every rank's rows under one name, each request counted once."""
    doc = R.info(trace)
    assert len(doc["instances"]) == 1, [(i["instance"], i["pp_ranks"]) for i in doc["instances"]]
    (inst,) = doc["instances"]
    assert inst["pp_ranks"] == pp_ranks and inst["tp_ranks"] == [0]
    assert [s["instance"] for s in doc["schedulers"]] == [inst["instance"]]
    # every request, also where vLLM's stop left a recorder_gap: each process handed its buffer over before the stop
    assert doc["requests"] == requests, (doc["requests"], requests)

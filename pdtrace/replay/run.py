"""`replay`: plan, run the dry run, compare."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdtrace.dryrun import run_dry_run
from pdtrace.replay.compare import SideReport, compare_decisions, decisions
from pdtrace.replay.plan import ReplayPlan, load_events, plan_replay
from pdtrace.trace.reader import open_trace


@dataclass
class ReplayResult:
    """The plan, the replay's dry-run error (vLLM raised) if any, and one report per side."""

    plan: ReplayPlan
    sides: list[SideReport]
    error: str | None = None
    output: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        """Matching decisions over all sides (of the longer run per side)."""
        total = sum(max(s.recorded, s.replayed) for s in self.sides)
        return sum(s.matched for s in self.sides) / max(total, 1)


def replay(trace: Any, output: Path | None = None, spawn: Any = None) -> ReplayResult:
    """Re-drive `trace` (a loaded Trace) on the installed vLLM; the replayed trace goes to `output` (kept) or a
    temporary directory (removed)."""
    plan = plan_replay(trace)
    recorded = load_events(trace)

    def run_into(out: Path) -> ReplayResult:
        result = run_dry_run(plan.config, out, spawn=spawn)
        replayed = load_events(open_trace(out))
        reports = []
        for role, side in plan.sides.items():
            instance = {"prefill": "prefill-0", "decode": "decode-0", "single": "engine-0"}[role]
            rec = decisions(recorded[recorded["instance"] == side.instance], plan.index_of)
            rep_events = replayed[replayed["instance"] == instance]
            replay_ids = {f"r{i:05d}{suffix}": i for i in range(plan.config.requests)
                          for suffix in ("", "-p", "-d")}
            reports.append(compare_decisions(role, rec, decisions(rep_events, replay_ids)))
        return ReplayResult(plan, reports, result.error, out if output is not None else None, list(plan.notes))

    if output is not None:
        return run_into(output)
    with tempfile.TemporaryDirectory(prefix="pdtrace-replay-") as tmp:
        return run_into(Path(tmp) / "trace")

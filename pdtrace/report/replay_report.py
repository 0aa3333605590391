"""The report of `pdtrace replay`: per side, the decisions matched and the first that differs. Only renders: the
comparison is `pdtrace.replay`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from pdtrace.replay import ReplayResult


def replay_summary(result: ReplayResult) -> dict[str, Any]:
    """The report as JSON-able data (`--format json`)."""
    return {"share": round(result.share, 4), "error": result.error, "notes": result.notes,
            "output": str(result.output) if result.output else None,
            "sides": [{"role": s.role, "instance": result.plan.sides[s.role].instance,
                       "instance_name": result.plan.sides[s.role].name or result.plan.sides[s.role].instance,
                       "recorded": s.recorded, "replayed": s.replayed, "matched": s.matched,
                       "share": round(s.share, 4), "first_divergence": s.first_divergence} for s in result.sides]}


def render_replay(console: Console, result: ReplayResult, vllm_version: str) -> None:
    """Text: one line per side, its first divergence, the notes on what the plan could not take from the trace."""
    console.print(f"pdtrace replay on vLLM {vllm_version}: {result.share:.1%} of the scheduler's decisions match the "
                  f"recording", markup=False)
    for s in result.sides:
        side = result.plan.sides[s.role]
        label = side.instance if side.name in ("", side.instance) else f"{side.name} = {side.instance}"
        console.print(f"  {s.role} ({label}): {s.matched} of {max(s.recorded, s.replayed)} decisions match "
                      f"(recorded {s.recorded}, replayed {s.replayed})", markup=False)
        d = s.first_divergence
        if d:
            console.print(f"    first divergence: decision {d['decision']} (recorded step {d['recorded_step']}, "
                          f"replayed step {d['replayed_step']}): {d['what']}", markup=False)
    if result.error:
        console.print(f"  vLLM raised in the replay: {result.error}", markup=False)
    for note in result.notes:
        console.print(f"  note: {note}", markup=False)
    if result.output:
        console.print(f"  the replayed trace: {result.output}", markup=False)

"""The rule registry. Built-in rules are found exactly like third-party ones: through the `pdtrace.rules`
entry-point group (see pyproject.toml), each entry point naming a `Rule` object."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from pdtrace.analysis.context import AnalysisContext

ENTRY_POINT_GROUP = "pdtrace.rules"


@dataclass(frozen=True)
class Rule:
    """One analysis rule: `run(ctx)` returns a findings DataFrame (columns of `pdtrace.analysis.findings`).

    `needs`: the shared tables (functions of the context, e.g. `pdtrace.analysis.requests.request_state`) the rule
    reads. Optional: analyze() builds them ahead of the rules, side by side on its threads
    (`pdtrace.analysis.parallel`); an undeclared table is still built when the rule first asks for it.
    `cost`: the rule's own run time in seconds at 10M events (bench/analyze.py --profile), a hint that only decides
    what starts first on those threads (the longest chain first, so it does not run alone at the end).
    `fallback`: the rule reports what no other rule explains (the lifecycle model's violations): a finding of it is
    left out where a finding of another rule, at warning or error, names the same instance, dp_rank and request, or
    cites the event it is about (`pdtrace.analysis.findings.explained_once`), so a violation is reported once, by
    the rule with its words.
    """

    id: str
    summary: str
    run: "Callable[[AnalysisContext], pd.DataFrame]"
    subrules: tuple[str, ...] = field(default=())
    needs: "tuple[Callable[[AnalysisContext], Any], ...]" = field(default=())
    cost: float = 0.05
    fallback: bool = False


class RuleLoadError(Exception):
    """A registered rule could not be imported or is not a Rule."""


def load_rules(errors: list[str] | None = None) -> dict[str, Rule]:
    """All registered rules by id, in entry-point order (built-ins first as pyproject lists them).

    A plugin that fails to load raises RuleLoadError, unless `errors` is given: then its message is appended there
    and the other rules still load (a broken third-party plugin must not hide the built-ins).
    """
    rules: dict[str, Rule] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            rule = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import error of a plugin is reported the same way
            problem = f"rule plugin {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}"
        else:
            if isinstance(rule, Rule):
                rules.setdefault(rule.id, rule)
                continue
            problem = f"rule plugin {ep.name!r} ({ep.value}) is not a pdtrace.analysis.registry.Rule"
        if errors is None:
            raise RuleLoadError(problem)
        errors.append(problem)
    return rules

"""The rule registry. Built-in rules are found exactly like third-party ones: through the `pdtrace.rules`
entry-point group (see pyproject.toml), each entry point naming a `Rule` object."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from pdtrace.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from pdtrace.analysis.context import AnalysisContext

ENTRY_POINT_GROUP = "pdtrace.rules"

#: What a finding does when what it rests on lies before the window of a trace that starts mid-run
#: (`pdtrace.analysis.history`): the actions of `Rule.window_policy`.
WINDOW_ACTIONS = ("drop", "downgrade", "keep", "drop_unless_started", "drop_unless_finished_later")
#: The kinds of history before a window a finding can rest on: the keys of a subrule's `Rule.window_policy` entry.
HISTORY_KINDS = ("request", "blocks", "step")


@dataclass(frozen=True)
class CrossInstance:
    """A rule's cross-instance part: how its findings on one instance can depend on another instance's rows, for the
    partitioned analysis (`pdtrace.analysis.partitions`), which analyses one instance at a time and then re-runs
    the rule on the rows of each group of instances linked by it (the whole-trace computation for them).

    `subrule`: the subrule whose findings cross instances (what the reports and docs name).
    `summarize(ctx, findings, instances)`: phase 1, on one partition (or one window of it): what of it may link it
    to another partition. `findings` are the rule's own findings there (as reported: after the window pass),
    `instances` the partition's own instance names (a name outside them is a peer). The value must be picklable
    (it crosses processes and Dask workers) and small: it is held for every partition until phase 2.
    `merge(parts)`: one partition's summary from its windows' (in window order), a superset being fine.
    `links(parts)`: phase 2: given every partition's (instances, summary) in partition order, the pairs of indices
    (a, b) of partitions whose findings of this rule depend on each other; linked partitions form groups
    (connected components) that are re-analysed together. Linking too much costs time only, never findings;
    linking too little loses the cross-instance findings.
    The three callables are module-level functions: a rule that is not registered travels to worker processes and
    Dask workers pickled, by reference to them.
    """

    subrule: str
    summarize: "Callable[[AnalysisContext, pd.DataFrame, frozenset[str]], Any]"
    merge: "Callable[[Sequence[Any]], Any]"
    links: "Callable[[Sequence[tuple[tuple[str, ...], Any]]], Any]"


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

    How the rule is judged on what it cannot see whole (declared here, read by the engine; a plugin declares them
    exactly as a built-in does):
    `window_policy`: subrule -> {kind of history before the window (`HISTORY_KINDS`: "request", "blocks", "step")
    -> action (`WINDOW_ACTIONS`)}, what a finding of that subrule does on a trace that starts mid-run (a flight dump,
    a `--since` cut) when that part of what it rests on lies before the window (`pdtrace.analysis.history`). A kind
    or subrule not named is downgraded one severity with the reason, the safe default for a rule that declares
    nothing; `drop` is for a finding that claims something did not happen, which may simply lie before the window.
    `status_proves`: subrules whose findings stand on the window's own rows when a completion they cite carries its
    recorded `status` (the scheduler's own word): kept unchanged but for `extra.window`, whatever lies before.
    `per_window`: None, or why the rule's findings measure the analysed span (idle fractions over it): in a
    windowed analysis (`pdtrace.analysis.windows`) each window then reports its own, marked `extra.windowed` with
    this reason, instead of the findings being kept by the window that owns their request.
    `cross_instance`: None, or the rule's cross-instance part (`CrossInstance`): how a partitioned analysis links
    instances for it. A rule without one is judged per partition only.
    """

    id: str
    summary: str
    run: "Callable[[AnalysisContext], pd.DataFrame]"
    subrules: tuple[str, ...] = field(default=())
    needs: "tuple[Callable[[AnalysisContext], Any], ...]" = field(default=())
    cost: float = 0.05
    fallback: bool = False
    window_policy: Mapping[str, Mapping[str, str]] = field(default_factory=dict, hash=False)
    status_proves: frozenset[str] = field(default=frozenset())
    per_window: str | None = None
    cross_instance: CrossInstance | None = None

    def __post_init__(self) -> None:
        for subrule, policy in self.window_policy.items():
            for kind, action in policy.items():
                if kind not in HISTORY_KINDS or action not in WINDOW_ACTIONS:
                    raise ValueError(f"rule {self.id!r}: window_policy[{subrule!r}] = {{{kind!r}: {action!r}}}: "
                                     f"kinds are {HISTORY_KINDS}, actions {WINDOW_ACTIONS}")
        object.__setattr__(self, "status_proves", frozenset(self.status_proves))

    def window_action(self, subrule: str, kind: str) -> str:
        """What a finding of `subrule` does when `kind` of what it rests on lies before the window (`window_policy`,
        "downgrade" where it says nothing)."""
        return self.window_policy.get(subrule, {}).get(kind, "downgrade")


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


def select_rules(rules: Iterable[str | Rule] | None, registered: Mapping[str, Rule] | None = None) -> list[Rule]:
    """The rules to run: all registered ones, or the given ids / Rule objects (unknown ids raise UsageError). The
    one resolver of rule ids (`analyze`, `pdtrace analyze --rule`, the partition workers). `registered`: the
    registered rules by id; None loads them (`load_rules`, a plugin that fails to load left out) only if needed."""
    if rules is None:
        return list((registered if registered is not None else load_rules(errors=[])).values())
    chosen: list[Rule] = []
    for item in rules:
        if isinstance(item, Rule):
            chosen.append(item)
            continue
        name = str(item).strip()
        if not name:
            continue
        if registered is None:
            registered = load_rules(errors=[])
        if name not in registered:
            raise UsageError(f"unknown rule {name!r} (known: {', '.join(sorted(registered))})")
        chosen.append(registered[name])
    if not chosen:
        raise UsageError("no rule selected")
    return chosen

"""The rule registry: built-ins come through the entry-point group; a broken plugin is reported, not fatal."""

from __future__ import annotations

import pytest

from pdtrace.analysis import analyze, available_rules, registry
from pdtrace.format import RULE_IDS
from pdtrace.trace.builder import EventBuilder


class _EntryPoint:
    def __init__(self, name: str, value: str, load) -> None:
        self.name, self.value, self._load = name, value, load

    def load(self):
        return self._load()


def test_every_builtin_rule_is_registered_through_the_entry_point_group() -> None:
    rules = registry.load_rules()
    assert set(RULE_IDS) <= set(rules)
    assert all(isinstance(rule, registry.Rule) and rule.id == rule_id for rule_id, rule in rules.items())


def test_a_broken_plugin_is_reported_and_the_others_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    good = registry.load_rules()["double_free"]

    def broken():
        raise ImportError("no module named thirdparty")

    fake = [_EntryPoint("double_free", "x:RULE", lambda: good), _EntryPoint("broken", "thirdparty:RULE", broken),
            _EntryPoint("notarule", "y:RULE", lambda: object())]
    monkeypatch.setattr(registry, "entry_points", lambda group: fake)
    with pytest.raises(registry.RuleLoadError, match="broken"):
        registry.load_rules()
    rules, notes = available_rules()
    assert list(rules) == ["double_free"]
    assert len(notes) == 2 and "thirdparty" in notes[0] and "not a pdtrace" in notes[1]


def test_a_third_party_rule_runs_like_a_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdtrace.analysis.findings import findings_frame

    def run(ctx):
        n = len(ctx.trace)
        return findings_frame([{"rule": "count_events", "severity": "info", "message": f"{n} events"}])

    rule = registry.Rule(id="count_events", summary="counts events", run=run)
    monkeypatch.setattr(registry, "entry_points", lambda group: [_EntryPoint("count_events", "z:RULE", lambda: rule)])
    b = EventBuilder()
    b.add("req_add", req="r1", n=4)
    findings = analyze(b.trace())
    assert findings["message"].tolist() == ["1 events"]
    assert findings.attrs["rules"] == ["count_events"]


def test_one_rule_id_resolver_for_analyze_and_the_partition_workers(monkeypatch):
    """`select_rules` resolves ids for `analyze` and for a partition worker (`partitions._resolve`): the same
    rules, the same one-line UsageError for an unknown id."""
    import pdtrace.analysis as analysis
    from pdtrace.analysis import partitions, registry
    from pdtrace.errors import UsageError

    assert analysis.select_rules is registry.select_rules
    registered = registry.load_rules(errors=[])
    some = sorted(registered)[:2]
    assert partitions._resolve(some) == registry.select_rules(some, registered) == [registered[i] for i in some]
    own = registry.Rule("own-rule", "a rule object travels as itself", lambda ctx: None)
    assert partitions._resolve([own, some[0]]) == [own, registered[some[0]]]
    for resolve in (partitions._resolve, lambda ids: registry.select_rules(ids, registered)):
        with pytest.raises(UsageError, match="unknown rule 'no-such-rule'"):
            resolve(["no-such-rule"])
    # Rule objects alone never load the registry
    monkeypatch.setattr(registry, "load_rules", lambda errors=None: pytest.fail("registry loaded"))
    assert registry.select_rules([own]) == [own]


def test_one_step_lookup_and_one_cpu_count():
    import numpy as np

    from pdtrace.analysis import columns, parallel, partitions, rulekit, steps

    keys, values = np.array([2, 5, 9], np.int64), np.array([20, 50, 90], np.int64)
    query = np.array([1, 2, 5, 6, 9, 10], np.int64)
    assert steps.lookup is columns.lookup
    assert rulekit.StepIndex._lookup(keys, values, query).tolist() == [-1, 20, 50, -1, 90, -1]
    assert rulekit.StepIndex._lookup(keys[:0], values[:0], query).tolist() == [-1] * 6
    assert steps.lookup(keys, values, query, -7).tolist() == [-7, 20, 50, -7, 90, -7]
    assert partitions.default_workers() == parallel.usable_cpus() >= 1
    assert parallel.default_jobs() == min(parallel.MAX_JOBS, parallel.usable_cpus())

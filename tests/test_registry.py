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

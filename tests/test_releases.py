"""Release ranges -> hook tables (pdtrace.recording.vllm) and release -> behaviour (pdtrace.analysis.releases),
without vLLM: hand-written traces whose engine_config names the release, as the hooks record it."""

from __future__ import annotations

import pytest
from scenarios import Engine, builder

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.releases import behaviour_of, grace_s, trace_release
from pdtrace.analysis.rules.double_free import RULE as DOUBLE_FREE
from pdtrace.recording.vllm import _patching, supported_versions, table_for


@pytest.mark.parametrize("version, table", [
    ("0.10.1.1", "v0_10"), ("0.10.2", "v0_10"), ("0.11.0", "v0_10"), ("0.11.1", "v0_11"), ("0.11.2", "v0_11"),
    ("0.12.0", "v0_11"), ("0.13.0", "v0_11"), ("0.14.0", "v0_14"), ("0.14.1", "v0_14"), ("0.15.0", "v0_14"),
    ("0.15.1", "v0_14"), ("0.16.0", "v0_16"), ("0.17.0", "v0_16"), ("0.17.1", "v0_16"),
    ("0.28.0", "v0_28"), ("0.29.0", "v0_28"), ("0.30.0", "v0_28"), ("0.31.0", "v0_28"), ("0.32.0", "v0_33"),
    ("0.33.0", "v0_33"), ("0.33.1+cpu", "v0_33"), ("0.31.2rc1", "v0_28"),
])
def test_each_release_maps_to_its_table(version, table):
    assert table_for(version).name == table


@pytest.mark.parametrize("version", ["0.10.0", "0.10.1", "0.27.1", "0.34.0", "1.0.0"])
def test_releases_outside_every_range_have_no_table(version):
    assert table_for(version) is None


def test_supported_ranges_name_every_tested_release_once():
    assert supported_versions() == ("0.10.1.1 to 0.11.0", "0.11.1 to 0.13.x", "0.14.0 to 0.15.x", "0.16.0 to 0.17.x",
                                    "0.28.0 to 0.31.x", "0.32.0 to 0.33.x")


def test_overlay_replaces_in_place_and_refuses_to_drop_an_unknown_hook():
    def factory(original):
        return original

    base = (_patching.Hook("m", "A", "f", factory), _patching.Hook("m", "A", "g", factory),
            _patching.Hook("m", "B", "h", factory))
    new_g = _patching.Hook("m", "A", "g", factory, ("x",))
    extra = _patching.Hook("m", "B", "k", factory)
    table = _patching.overlay(base, replace=(new_g, extra), drop=("B.h",))
    assert table == (base[0], new_g, extra)
    with pytest.raises(ValueError, match="A.nope"):
        _patching.overlay(base, drop=("A.nope",))


def test_behaviour_per_release_range():
    old, mid, new = behaviour_of("0.10.2"), behaviour_of("0.11.2"), behaviour_of("0.33.0")
    assert (old.deferred_frees, old.abort_while_receiving, old.connector_timeout_s) == (False, "immediate", 120.0)
    assert (mid.deferred_frees, mid.abort_while_receiving, mid.connector_timeout_s) == (False, "immediate", 480.0)
    assert (new.deferred_frees, new.abort_while_receiving, new.connector_timeout_s) == (True, "delayed", 480.0)
    assert "KeyError" in old.unknown_send and "warning" in behaviour_of("0.11.0").unknown_send
    assert "asserts" in new.unknown_send and behaviour_of(None) == new and behaviour_of("9.9.9") == new
    assert [behaviour_of(v).steps_for_pending_sends for v in ("0.10.1.1", "0.11.0", "0.11.2", "0.28.0", "0.33.0")] \
        == [False, False, False, True, True]


@pytest.mark.parametrize("version, abort, unknown_recv", [
    ("0.11.2", "immediate", "unchecked"), ("0.12.0", "immediate", "unchecked"), ("0.13.0", "immediate", "unchecked"),
    ("0.15.1", "immediate", "unchecked"), ("0.16.0", "delayed", "asserts"), ("0.17.1", "delayed", "asserts"),
])
def test_abort_while_receiving_is_delayed_and_unknown_receives_assert_from_0_16(version, abort, unknown_recv):
    row = behaviour_of(version)
    assert (row.abort_while_receiving, row.deferred_frees, row.steps_for_pending_sends) == (abort, False, False)
    assert unknown_recv in row.unknown_recv and "asserts" in row.unknown_send and row.connector_timeout_s == 480.0


def _unknown_completion_trace(version: str | None, sources: bool = False):
    """P side: r1 sent and freed, then a second send completion for r1, which the scheduler no longer knows."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", config=False)
    detail = {"block_size": 16, "pp": 1, "tp": 1, "dp": 1, "defer_block_free": False, "kv_role": "kv_producer"}
    if version is not None:
        detail.update(vllm_version=version, table=table_for(version).name)
    p.ev("engine_config", n=64, detail=detail)
    p.add("r1", n=32, remote_decode=True)
    p.step({"r1": 32}, alloc={"r1": [1, 2]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    p.step({})
    p.output()
    p.send_done("r1")
    p.step({})
    p.output()
    p.ev("kv_send_done", step=p._current_step(), req="r1", status="unknown")
    return b.trace()


def test_the_recorded_release_sets_the_grace_period_unless_configured():
    old = AnalysisContext(_unknown_completion_trace("0.10.2"))
    new = AnalysisContext(_unknown_completion_trace("0.33.0"))
    assert trace_release(old) == "0.10.2" and grace_s(old) == 120.0 and grace_s(new) == 480.0
    configured = AnalysisContext(old.trace, AnalysisConfig().with_overrides(grace_s=30.0))
    assert grace_s(configured) == 30.0
    unnamed = AnalysisContext(_unknown_completion_trace(None))
    assert trace_release(unnamed) is None and grace_s(unnamed) == 480.0


@pytest.mark.parametrize("version, effect", [
    ("0.10.1.1", "raises KeyError"), ("0.11.0", "logs a warning"), ("0.33.0", "asserts req_id in self.requests"),
])
def test_completion_for_a_forgotten_id_says_what_the_recorded_release_does(version, effect):
    # after the final free (reason sent) the id is forgotten: completion_after_free, whatever the status says
    findings = DOUBLE_FREE.run(AnalysisContext(_unknown_completion_trace(version)))
    after = findings[findings["subrule"] == "completion_after_free"]
    assert len(after) == 1 and effect in after.iloc[0]["message"]
    assert (findings["subrule"] == "unknown_id").sum() == 0


@pytest.mark.parametrize("version, effect", [
    ("0.10.1.1", "raises KeyError"), ("0.11.0", "logs a warning"), ("0.33.0", "asserts req_id in self.requests"),
])
def test_unknown_id_message_says_what_the_recorded_release_does(version, effect):
    # status unknown for an id no free in the trace explains (added before the recording began)
    b = builder()
    p = Engine(b, instance="P", role="prefill", config=False)
    p.ev("engine_config", n=64, detail={"block_size": 16, "pp": 1, "tp": 1, "dp": 1, "defer_block_free": False,
                                        "kv_role": "kv_producer", "vllm_version": version,
                                        "table": table_for(version).name})
    p.step({})
    p.output()
    p.ev("kv_send_done", step=p._current_step(), req="r0", status="unknown")
    findings = DOUBLE_FREE.run(AnalysisContext(b.trace()))
    unknown = findings[findings["subrule"] == "unknown_id"]
    assert len(unknown) == 1 and effect in unknown.iloc[0]["message"]


def _ci_matrix():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("vllm_matrix", Path(__file__).parents[1] / ".ci" / "vllm_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_ci_matrix_runs_every_table_and_every_behaviour_row_once():
    from pdtrace.recording.vllm import _TABLES

    matrix = _ci_matrix()
    picked = matrix.default_matrix()
    assert len(picked) == len(set(picked))
    for entry in _TABLES:
        mine = [v for v in picked if table_for(v) == entry]
        if not entry.tested:  # never passed yet: its newest release, so that CI tries it
            assert mine == [entry.releases[-1]]
            continue
        assert entry.tested[-1] in mine and set(entry.splits) <= set(mine) <= set(entry.tested)
        assert {behaviour_of(v) for v in mine} == {behaviour_of(v) for v in entry.tested}
    v0_10 = [v for v in picked if table_for(v).name == "v0_10"]
    assert v0_10 == ["0.11.0", "0.10.1.1"]  # 0.10.2 adds nothing: 0.10.1.1 has its behaviour row and more
    assert matrix.all_versions() == [v for entry in _TABLES for v in entry.releases]

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
    ("0.15.1", "v0_14"), ("0.16.0", "v0_16"), ("0.17.0", "v0_17"), ("0.17.1", "v0_17"),
    ("0.18.0", "v0_18"), ("0.20.0", "v0_18"), ("0.23.0", "v0_18"), ("0.24.0", "v0_24"), ("0.25.1", "v0_24"),
    ("0.26.0", "v0_26"), ("0.27.0", "v0_27"), ("0.27.1", "v0_27"),
    ("0.28.0", "v0_28"), ("0.29.0", "v0_28"), ("0.30.0", "v0_28"), ("0.31.0", "v0_28"), ("0.32.0", "v0_33"),
    ("0.33.0", "v0_33"), ("0.33.1+cpu", "v0_33"), ("0.31.2rc1", "v0_28"),
])
def test_each_release_maps_to_its_table(version, table):
    assert table_for(version).name == table


@pytest.mark.parametrize("version", ["0.10.0", "0.10.1", "0.34.0", "1.0.0"])
def test_releases_outside_every_range_have_no_table(version):
    assert table_for(version) is None


def test_supported_ranges_name_every_tested_release_once():
    assert supported_versions() == ("0.10.1.1 to 0.11.0", "0.11.1 to 0.13.x", "0.14.0 to 0.15.x", "0.16.0 to 0.16.x",
                                    "0.17.0 to 0.17.x", "0.18.0 to 0.23.x", "0.24.0 to 0.25.x", "0.26.0 to 0.26.x",
                                    "0.27.0 to 0.27.x", "0.28.0 to 0.31.x", "0.32.0 to 0.33.x")


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
    # 0.18-0.27: the abort delay and both asserts throughout; the engine steps for pending sends from 0.22, frees may
    # be deferred from 0.24
    rows = [behaviour_of(v) for v in ("0.18.0", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.25.1", "0.27.1")]
    assert [r.steps_for_pending_sends for r in rows] == [False, False, True, True, True, True, True]
    assert [r.deferred_frees for r in rows] == [False, False, False, False, True, True, True]
    assert {(r.abort_while_receiving, r.unknown_send, r.unknown_recv, r.connector_timeout_s) for r in rows} \
        == {("delayed", new.unknown_send, new.unknown_recv, 480.0)}


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


def test_default_ci_matrix_runs_each_table_once_on_its_newest_tested_release():
    from pdtrace.recording.vllm import _TABLES

    picked = _ci_matrix().default_matrix()
    assert [table_for(v) for v in picked] == list(_TABLES)
    for entry, version in zip(_TABLES, picked):
        assert version == (entry.tested[-1] if entry.tested else entry.releases[-1])


def test_behaviours_ci_matrix_runs_every_table_and_every_behaviour_row_once():
    from pdtrace.recording.vllm import _TABLES

    matrix = _ci_matrix()
    picked = matrix.behaviour_matrix()
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


# -- NIXL's send lease (0.22+): the prefill side's grace is a 30 s lease the decode side's heartbeats renew ---------
def _config(version: str, kv_role: str) -> dict:
    return {"block_size": 16, "pp": 1, "tp": 1, "dp": 1, "defer_block_free": False, "kv_role": kv_role,
            "connector": "NixlConnector", "vllm_version": version, "table": table_for(version).name}


def _lost_send_trace(version: str, decode: str = "read", hold_s: float = 40.0, decode_sends: bool = False):
    """P finishes r1 with delay_free and never sees its send complete; D's r1-d (naming r1 on P) has read it
    (`decode="read"`), still waits for it at the end (`"waits"`), or is not in the trace (`"absent"`). The trace
    ends hold_s after. `decode_sends`: D's request also finishes with delay_free (bidirectional: D holds blocks
    for a later read, under its own TTL) and never sees that send complete either."""
    b = builder()
    p = Engine(b, instance="P", role="prefill", config=False)
    p.ev("engine_config", n=64, detail=_config(version, "kv_producer"))
    d = Engine(b, instance="D", role="decode", config=False)
    d.ev("engine_config", n=64, detail=_config(version, "kv_consumer"))
    p.add("r1", n=40, remote_decode=True)
    p.step({"r1": 40}, alloc={"r1": [1, 2, 3]})
    p.output()
    p.finish("r1", reason="length", delay_free=True)
    if decode != "absent":
        d.add("r1-d", n=40, remote_prefill=True, remote_instance="P", remote_req="r1")
        d.step({}, wait_kv={"r1-d": [5, 6, 7]})
        d.output()
        if decode == "read":
            d.step({})
            d.output()
            d.recv_done("r1-d")
            d.step({"r1-d": 1})
            d.output()
            d.finish("r1-d", reason="length", delay_free=decode_sends)
    b.advance(int(hold_s * 1e9))
    for engine in (p, d):
        engine.step({})
        engine.output()
    return b.trace()


def _leaks(trace, **config):
    from pdtrace.analysis.rules.leaked_blocks import RULE as LEAKED

    ctx = AnalysisContext(trace, AnalysisConfig().with_overrides(**config) if config else AnalysisConfig())
    found = LEAKED.run(ctx)
    return {(f.instance, f.req): (f.subrule, f.message) for f in found.itertuples()}


@pytest.mark.parametrize("version", ["0.22.0", "0.23.0", "0.27.1", "0.33.0"])
def test_nixl_prefill_side_send_is_lost_a_lease_after_the_decode_side_stopped_waiting(version):
    # D read r1 and finished; P still holds r1's blocks 40 s later: past the 30 s lease nothing renews any more.
    found = _leaks(_lost_send_trace(version))
    subrule, message = found[("P", "r1")]
    assert subrule == "indirectly" and "NIXL's lease (30 s" in message
    assert behaviour_of(version).nixl_send_lease_s == 30.0


@pytest.mark.parametrize("version", ["0.18.0", "0.21.0", "0.11.2"])
def test_before_0_22_the_prefill_side_send_has_nixls_abort_timeout(version):
    # the same 40 s: within VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s), not a leak yet
    subrule, message = _leaks(_lost_send_trace(version))[("P", "r1")]
    assert subrule == "still_held" and "grace period (480 s)" in message
    assert behaviour_of(version).nixl_send_lease_s is None


@pytest.mark.parametrize("version,idles", [("0.17.1", True), ("0.21.0", True), ("0.33.0", False)])
def test_a_send_still_held_after_the_decode_side_read_it_cites_the_read(version, idles):
    # P still holds r1 10 s after D received it (kv_recv_done): the completion waits for P's next step, which an
    # engine before 0.22 takes only with its next request (it does not step with only sends pending)
    from pdtrace.analysis.rules.leaked_blocks import RULE as LEAKED

    trace = _lost_send_trace(version, hold_s=10.0)
    found = LEAKED.run(AnalysisContext(trace, AnalysisConfig()))
    held = found[(found["instance"] == "P") & (found["req"] == "r1")].iloc[0]
    assert held["subrule"] == "still_held" and held["extra"]["peer_read"] is True
    assert "the decode side already read it" in held["message"]
    assert ("does not step with only sends pending" in held["message"]) is idles
    read = [e for e in held["evidence"] if e.get("kind") == "kv_recv_done"]
    assert len(read) == 1 and read[0]["instance"] == "D" and read[0]["req"] == "r1-d"
    # D still waiting: nothing read, nothing cited
    waiting = LEAKED.run(AnalysisContext(_lost_send_trace(version, decode="waits", hold_s=10.0), AnalysisConfig()))
    held = waiting[(waiting["instance"] == "P") & (waiting["req"] == "r1")].iloc[0]
    assert held["extra"]["peer_read"] is False and "already read" not in held["message"]


def test_nixl_lease_is_renewed_while_the_decode_side_still_waits():
    # D still waits for the read after 100 s: its heartbeats keep P's lease alive, P's blocks are held for that wait
    found = _leaks(_lost_send_trace("0.33.0", decode="waits", hold_s=100.0))
    assert found[("P", "r1")][0] == "still_held" and "grace period (480 s)" in found[("P", "r1")][1]
    assert ("D", "r1-d") not in found  # a wait in flight, not a leak
    # past the longest timeout D's wait is lost, and P's blocks, held for it, with it
    found = _leaks(_lost_send_trace("0.33.0", decode="waits", hold_s=600.0))
    assert found[("P", "r1")][0] == found[("D", "r1-d")][0] == "indirectly"


def test_nixl_lease_without_the_decode_side_in_the_trace_keeps_the_longest_timeout():
    # who renews the lease cannot be seen: 40 s is within 480 s, 600 s is not
    assert _leaks(_lost_send_trace("0.33.0", decode="absent"))[("P", "r1")][0] == "still_held"
    assert _leaks(_lost_send_trace("0.33.0", decode="absent", hold_s=600.0))[("P", "r1")][0] == "indirectly"


def test_nixl_decode_side_send_keeps_its_ttl_and_a_configured_grace_overrides_the_lease():
    # D's own delayed free (bidirectional, decoder_kv_blocks_ttl 480 s): 40 s is within it; P's is past its lease
    found = _leaks(_lost_send_trace("0.33.0", decode_sends=True))
    assert found[("D", "r1-d")][0] == "still_held" and "grace period (480 s)" in found[("D", "r1-d")][1]
    assert found[("P", "r1")][0] == "indirectly"
    configured = _leaks(_lost_send_trace("0.33.0"), grace_s=100.0)
    assert configured[("P", "r1")][0] == "still_held" and "grace period (100 s)" in configured[("P", "r1")][1]

"""`pdtrace show` and the story functions behind it."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pdtrace.analysis.story import collapse_runs, related_requests, request_story, step_ranks, step_story
from pdtrace.trace.builder import EventBuilder
from scenarios import Engine, builder, deferred_frees, healthy_pd
from scenarios_pipeline import healthy_pp4, pp_recv_pp2


def lagging_rank_trace() -> object:
    """PP=2, step 0: rank 1's exec_end comes after the step_output (no connector: only the output rank replies);
    rank 1 never executes step 1."""
    b = EventBuilder(instance="E", role="both")
    b.add("engine_config", n=64, detail={"pp": 2, "tp": 1, "block_size": 16})
    b.add("req_add", req="a", n=16)
    b.add("sched", step=0, n=16, detail={"running": 1, "free_blocks": 60})
    b.add("req_sched", step=0, req="a", n=16)
    b.add("step_submit", component="engine", step=0, n=1)
    b.add("exec_begin", pid=2000, pp_rank=0, tp_rank=0, step=0, n=16)
    b.add("exec_end", pid=2000, pp_rank=0, tp_rank=0, step=0, n=16)
    b.add("exec_begin", pid=2001, pp_rank=1, tp_rank=0, step=0, n=16)
    b.add("step_output", component="engine", step=0)
    b.add("req_finish", step=0, req="a", reason="length", status="RUNNING", delay_free=False)
    b.add("exec_end", pid=2001, pp_rank=1, tp_rank=0, step=0, n=16)
    b.add("sched", step=1, n=0, detail={"running": 0})
    b.add("step_submit", component="engine", step=1, n=1)
    b.add("exec_begin", pid=2000, pp_rank=0, tp_rank=0, step=1, n=0)
    b.add("exec_end", pid=2000, pp_rank=0, tp_rank=0, step=1, n=0)
    b.add("step_output", component="engine", step=1)
    return b.trace()


def test_request_story_joins_prefill_and_decode():
    trace = healthy_pd()
    assert related_requests(trace, "r1", "D") == [("D", "r1"), ("P", "r1")]
    story = request_story(trace, "r1", "D")
    assert set(story["instance"]) == {"P", "D"}
    kinds = list(story["kind"])
    for kind in ("req_add", "blocks_alloc", "req_wait_kv", "remote_read", "kv_send_done", "kv_recv_done",
                 "req_finish", "blocks_pool_free"):
        assert kind in kinds
    assert story["ts_ns"].is_monotonic_increasing
    assert story["t_ns"].iloc[0] == 0


def test_request_story_follows_renamed_remote_ids():
    b = builder()
    p = Engine(b, instance="P", role="prefill", pid=1000)
    d = Engine(b, instance="D", role="decode", pid=2000)
    p.add("p-77", n=32, remote_decode=True)
    p.step({"p-77": 32}, alloc={"p-77": [1, 2]})
    p.output()
    p.finish("p-77", reason="length", delay_free=True)
    d.add("d-5", n=32, remote_prefill=True, remote_instance="P", remote_req="p-77", remote_blocks=2)
    d.add("other", n=32)
    trace = b.trace()
    from_d = request_story(trace, "d-5")
    assert set(zip(from_d["instance"], from_d["req"], strict=True)) == {("P", "p-77"), ("D", "d-5")}
    from_p = request_story(trace, "p-77")
    assert ("D", "d-5") in set(zip(from_p["instance"], from_p["req"], strict=True))
    assert "other" not in set(from_p["req"])


def test_request_story_includes_the_deferred_drain():
    story = request_story(deferred_frees(), "r1")
    drains = story[(story["kind"] == "blocks_pool_free") & story["req"].isna()]
    assert len(drains) == 1 and 1 in drains.iloc[0]["blocks"]


def test_unknown_request_gives_an_empty_story():
    assert len(request_story(healthy_pd(), "nope")) == 0
    assert len(request_story(healthy_pd(), "r1", instance="X")) == 0


def test_collapse_runs():
    story = request_story(healthy_pd(), "r1")
    short = collapse_runs(story)
    run = short[short["kind"] == "req_sched"]
    assert list(run["count"]) == [1, 2]
    assert int(run.iloc[1]["step"]) == 2 and int(run.iloc[1]["last_step"]) == 3 and int(run.iloc[1]["n"]) == 2


def test_step_story_and_ranks_full_pipeline():
    trace = healthy_pp4()
    story = step_story(trace, 5)
    assert set(story["step"]) == {5}
    assert {"sched", "req_sched", "step_submit", "exec_begin", "exec_end", "step_output"} <= set(story["kind"])
    ranks = step_ranks(trace, 5)
    assert list(ranks["pp_rank"]) == [0, 1, 2, 3]
    assert set(ranks["relation"]) == {"before"}


def test_step_ranks_lagging_and_missing_rank():
    trace = lagging_rank_trace()
    r0 = step_ranks(trace, 0).set_index("pp_rank")["relation"].to_dict()
    assert r0 == {0: "before", 1: "after"}
    r1 = step_ranks(trace, 1).set_index("pp_rank")["relation"].to_dict()
    assert r1 == {0: "before", 1: "never"}


def test_cli_show_request(cli, tmp_path):
    healthy_pd_dir = tmp_path / "pd"
    from pdtrace.trace.builder import write_table
    write_table(healthy_pd().table, healthy_pd_dir)
    res = cli("show", healthy_pd_dir, "--req", "r1", "--instance", "D")
    assert res.exit_code == 0, res.stderr
    assert "request r1 (D:r1, P:r1)" in res.stdout
    assert "kv_send_done" in res.stdout and "req_sched x2" in res.stdout and "steps 2..3" in res.stdout
    full = cli("show", healthy_pd_dir, "--req", "r1", "--full")
    assert "req_sched x2" not in full.stdout
    js = cli("show", healthy_pd_dir, "--req", "r1", "--format", "json")
    doc = json.loads(js.stdout)
    assert {"instance": "P", "req": "r1"} in doc["requests"]
    assert doc["events"][0]["kind"] == "req_add" and doc["events"][0]["detail"] == {"remote_decode": True}


def test_cli_show_step_says_which_ranks_came_before_the_output(cli, tmp_path):
    from pdtrace.trace.builder import write_table
    write_table(lagging_rank_trace().table, tmp_path / "t")
    res = cli("show", tmp_path / "t", "--step", "0")
    assert res.exit_code == 0, res.stderr
    assert "update_from_output(0) on E/dp0" in res.stdout
    assert "pp0/tp0 before" in res.stdout and "pp1/tp0 after" in res.stdout
    assert "waited for every rank: no, 1/2" in res.stdout
    assert "completions in step 0's update: req_finish a" in res.stdout
    res1 = cli("show", tmp_path / "t", "--step", "1", "--format", "json")
    doc = json.loads(res1.stdout)
    assert {r["pp_rank"]: r["relation"] for r in doc["ranks"]} == {0: "before", 1: "never"}
    assert doc["waited_for_every_rank"] == {"E/dp0": False}
    write_table(healthy_pp4().table, tmp_path / "pp4")
    ok = cli("show", tmp_path / "pp4", "--step", "5")
    assert "waited for every rank: yes, 4/4" in ok.stdout


def test_cli_show_step_shows_each_ranks_wait_inside_its_rpc(cli, tmp_path):
    """Issue 36 item 7: per rank, the time its RPC waited for the previous stage (exec_wait_*), out of its span,
    and the busy rest; in the JSON `wait_ns` / `wait_for`. Twin: the same run without the wait rows says nothing
    of a wait (wait_ns null)."""
    from pdtrace.trace.builder import write_table
    write_table(pp_recv_pp2("recorded").table, tmp_path / "rec")
    write_table(pp_recv_pp2("hidden").table, tmp_path / "hid")
    res = cli("show", tmp_path / "rec", "--step", "2")
    assert res.exit_code == 0, res.stderr
    assert "pp1/tp0 before" in res.stdout and "(waited 8.000 of 10.000 ms for pp_recv, busy 2.000 ms)" in res.stdout
    assert "exec_wait_begin" in res.stdout and "exec_wait_end" in res.stdout
    doc = json.loads(cli("show", tmp_path / "rec", "--step", "2", "--format", "json").stdout)
    waits = {r["pp_rank"]: (r["wait_ns"], r["wait_for"]) for r in doc["ranks"]}
    assert waits == {0: (None, None), 1: (8_000_000, "pp_recv")}
    hidden = cli("show", tmp_path / "hid", "--step", "2")
    assert hidden.exit_code == 0 and "waited 8" not in hidden.stdout and "pp1/tp0 before" in hidden.stdout
    doc = json.loads(cli("show", tmp_path / "hid", "--step", "2", "--format", "json").stdout)
    assert [r["wait_ns"] for r in doc["ranks"]] == [None, None]


@pytest.mark.parametrize("args, message", [
    (["--req", "missing"], "request 'missing' not found"),
    (["--step", "999"], "step 999 not found"),
    (["--step", str(2**80)], f"step {2**80} not found"),  # beyond int64: no row has it, no overflow
    (["--step", str(-2**80)], f"step {-2**80} not found"),
    (["--step", "1", "--instance", "nowhere"], "step 1 not found"),
    ([], "exactly one of --req"),
    (["--req", "a", "--step", "1"], "exactly one of --req"),
])
def test_cli_show_bad_usage_is_one_line_exit_2(cli, tmp_path, args, message):
    from pdtrace.trace.builder import write_table
    write_table(lagging_rank_trace().table, tmp_path / "t")
    res = cli("show", tmp_path / "t", *args)
    assert res.exit_code == 2
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert res.stdout == ""


def test_cli_show_unreadable_trace(cli, tmp_path):
    res = cli("show", tmp_path / "nothing", "--req", "a")
    assert res.exit_code == 2 and "Traceback" not in res.stderr


def empty_run_trace() -> object:
    """PP=2 with a multi-process executor: step 0 carries a request; steps 1..3 are empty and the recorder folded
    them into step 1's `sched` row (detail empty_run = 3, one step_submit and one step_output, step 1's); the
    workers, in their own processes, recorded a no-forward exec span for each. Step 5 was submitted and executed
    but never got its step_output (the engine stopped)."""
    b = EventBuilder(instance="E", role="none")
    b.add("engine_config", n=64, detail={"pp": 2, "tp": 1, "block_size": 16})
    b.add("req_add", req="a", n=16)
    for step, tokens in ((0, 16), (1, 0), (4, 1), (5, 1)):
        detail = {"running": 1, "free_blocks": 60}
        if step == 1:
            detail["empty_run"] = 3
        b.add("sched", step=step, n=tokens, detail=detail)
        b.add("step_submit", component="engine", step=step, n=1)
        for k in ((1, 2, 3) if step == 1 else (step,)):
            for pp in (0, 1):
                b.add("exec_begin", pid=2000 + pp, pp_rank=pp, tp_rank=0, step=k, n=tokens)
                b.add("exec_end", pid=2000 + pp, pp_rank=pp, tp_rank=0, step=k, n=tokens)
        if step != 5:
            b.add("step_output", component="engine", step=step)
    return b.trace()


def test_show_step_inside_an_empty_run_names_the_run(cli, tmp_path):
    from pdtrace.analysis.story import folded_steps
    from pdtrace.trace.builder import write_table

    trace = empty_run_trace()
    assert folded_steps(trace, 2)[["instance", "first_step", "last_step"]].values.tolist() == [["E", 1, 3]]
    assert len(folded_steps(trace, 1)) == 0 and len(folded_steps(trace, 4)) == 0  # the head, and past the run
    assert set(step_ranks(trace, 2)["relation"]) == {"empty_run"}
    write_table(trace.table, tmp_path / "t")
    res = cli("show", tmp_path / "t", "--step", "2")
    assert res.exit_code == 0, res.stderr
    assert "no step_output recorded" not in res.stdout
    assert "one of steps 1..3 recorded as one row (empty_run)" in res.stdout
    doc = json.loads(cli("show", tmp_path / "t", "--step", "3", "--format", "json").stdout)
    assert doc["waited_for_every_rank"] == {"E/dp0": None}
    assert doc["empty_run"] == [{"instance": "E", "dp_rank": 0, "first_step": 1, "last_step": 3}]
    # the look-alike: a step that really has no step_output is still said to have none
    lost = cli("show", tmp_path / "t", "--step", "5")
    assert "update_from_output(5) on E/dp0: no step_output recorded" in lost.stdout
    assert set(step_ranks(trace, 5)["relation"]) == {"no_output"}
    head = cli("show", tmp_path / "t", "--step", "1")
    assert "waited for every rank: yes, 2/2" in head.stdout


def _unconfigured_lagging_rank() -> object:
    """lagging_rank_trace without its engine_config: the lanes step 1 expects (rank 1's, which never executes it)
    are known only from the exec rows of other steps."""
    from pdtrace.trace.model import Trace

    trace = lagging_rank_trace()
    return Trace.from_table(trace.table.filter(pc.not_equal(pc.cast(trace.table.column("kind"), pa.string()),
                                                            "engine_config")))


BUILT_STORIES = {"healthy_pd": healthy_pd, "deferred_frees": deferred_frees, "empty_run": empty_run_trace,
                 "lagging_rank": lagging_rank_trace, "unconfigured_lagging_rank": _unconfigured_lagging_rank,
                 "pp_recv": pp_recv_pp2}


SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def _story_names() -> list[str]:
    return sorted(p.name for p in SAMPLES.iterdir() if (p / "trace").is_dir()) + sorted(BUILT_STORIES)


def _story_trace(name: str) -> object:
    from pdtrace.trace.reader import open_trace

    return BUILT_STORIES[name]() if name in BUILT_STORIES else open_trace(SAMPLES / name / "trace", warn=False)


def _same(got: pd.DataFrame, want: pd.DataFrame, what: str) -> None:
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True), obj=what)


@pytest.mark.parametrize("name", _story_names())
def test_a_story_read_alone_is_the_whole_traces(name, tmp_path):
    """`show` reads only a request's or a step's rows (`request_rows`, `step_rows`); the stories must be those of
    the whole trace: a spread of the sample's requests and steps, with and without --instance."""
    from pdtrace.analysis.columns import columns
    from pdtrace.analysis.context import AnalysisContext
    from pdtrace.analysis.story import folded_steps, request_rows, step_rows
    from pdtrace.trace.builder import write_table

    whole = _story_trace(name)
    path = tmp_path / "t"
    write_table(whole.table, path)
    cols = columns(AnalysisContext(whole))
    req_names = cols.codes("req")[1]
    instances = cols.codes("instance")[1]
    stride = max(1, len(req_names) // 3)
    for req in req_names[::stride] + req_names[-1:]:
        for instance in [None] + instances[-1:]:
            rows = request_rows(path, req, instance)
            assert len(rows) < len(whole) or len(req_names) == 1
            _same(request_story(rows, req, instance), request_story(whole, req, instance), f"{req} {instance}")
            assert related_requests(rows, req, instance) == related_requests(whole, req, instance)
    steps = sorted({int(s) for s in cols.step[cols.step >= 0].tolist()})
    for step in steps[::max(1, len(steps) // 3)] + steps[-1:] + [max(steps, default=0) + 1]:
        rows, lanes = step_rows(path, step)
        for instance in [None] + instances[-1:]:
            _same(step_story(rows, step, instance), step_story(whole, step, instance), f"step {step} {instance}")
            _same(step_ranks(rows, step, instance, lanes), step_ranks(whole, step, instance), f"ranks {step}")
            _same(folded_steps(rows, step, instance), folded_steps(whole, step, instance), f"folded {step}")


def test_show_reads_only_the_story(cli, tmp_path):
    """`show` never loads the whole trace: each read it makes is filtered to the story's rows."""
    from unittest import mock

    from pdtrace.trace import reader
    from pdtrace.trace.builder import write_table

    write_table(healthy_pd().table, tmp_path / "t")
    real = reader.open_trace
    for args in (("--req", "r1"), ("--step", "2")):
        calls = []

        def spy(*a, **kwargs):
            calls.append(kwargs.get("rows"))
            return real(*a, **kwargs)

        # (mock.patch, not monkeypatch: the cli fixture undoes monkeypatch after each call)
        with mock.patch.object(reader, "open_trace", spy), mock.patch("pdtrace.analysis.story.open_trace", spy):
            assert cli("show", tmp_path / "t", *args).exit_code == 0
        assert calls and all(rows is not None for rows in calls), args


def test_cli_show_reads_a_trace_by_url(cli, tmp_path):
    """show takes the locations analyze and info take: a file:// URL (the Path argument it had mangled it)."""
    from pdtrace.trace.builder import write_table

    write_table(healthy_pd().table, tmp_path / "t")
    by_path = cli("show", tmp_path / "t", "--req", "r1", "--format", "json")
    by_url = cli("show", (tmp_path / "t").as_uri(), "--req", "r1", "--format", "json")
    assert by_url.exit_code == 0, by_url.stderr
    assert json.loads(by_url.stdout)["events"] == json.loads(by_path.stdout)["events"]

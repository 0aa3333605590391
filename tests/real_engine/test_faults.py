"""Real engine, faults and stresses. Each run's right answer was written here before the run was first made.

1. KV cache too small (offline, 16 blocks of 32 tokens for 10 requests of 48 + 96 tokens, 8 at a time; the
   first draft's 16-token blocks are refused by vLLM's CPU attention, which wants multiples of 32).
   Right answer: vLLM preempts and resumes; every request still finishes with its 96 tokens; the trace has
   req_preempt rows, every preempted request is scheduled again after its preemption and finishes, its blocks
   are freed with reason `preempted` at the preemption and every block allocated is freed by the end; on the
   worker a preempted request comes back with batch_add `resumed` and no batch_add says `resumed` for a request
   that was not preempted; analyze reports no error or warning (preemption is not a race, a leak or a livelock).

2. A worker rank killed (offline, SIGKILL of the only worker a few seconds into generation; 16 requests of 900
   tokens, all running at once: the first draft ran 4 at a time, and the 12 queued behind them were rightly
   reported `never_scheduled` (warning: an overloaded pool, over starve_steps before the crash), which is the
   queue's story, not the crash's).
   Right answer: the engine dies and the script fails; the trace holds an `engine_error` (the executor failed),
   every request was added (req_add for all N: LLM.generate adds them all before the first step), the steps
   before the error are all there (sched steps 0..K without a hole, each with its step_submit) and no
   recorder_off; analyze reports no error for the requests the crash left unfinished: their findings, if any, are
   info with `engine_failed` (a consequence of the crash, not a scheduler bug).

3. The decode side never reads (a prefill server with the NIXL connector, kv_lease_duration 6 s, and no decode
   server: the client takes P's kv_transfer_params and never forwards them, as when D dies mid-transfer).
   Right answer: P finishes each request with delay_free (its blocks held for the read). Batch A, sent first and
   left past the lease: vLLM's lease expiry reports the send finished (kv_send_done) about 6 s after the
   finish, and the blocks are freed (reason `sent`) after it; no error finding. Batch B, sent 2 s before the stop:
   still held at the end of the trace; by default `leaked_blocks/still_held` (info) for each B request and no
   error or warning; with `--grace-s 1` the B requests are reported as leaked (warning or error) awaiting
   kv_send_done.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

import real_engines as R  # noqa: E402
from engine_checks import assert_healthy_findings, requests_of  # noqa: E402

R.skip_unless_vllm_cpu()
pytestmark = pytest.mark.real_vllm

# ---------------------------------------------------------------------------------------------- 1. tiny KV cache
N_TINY = 10
TINY_TOKENS = 96


@pytest.fixture(scope="module")
def tiny_kv(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_kv")
    spec = {"model": R.tiny_model(root), "requests": N_TINY, "prompt_len": 48, "max_tokens": TINY_TOKENS, "pp": 1,
            "kv_blocks": 16, "block_size": 32, "max_model_len": 256, "max_num_seqs": 8}
    run = R.record_offline(root / "trace", spec, R.engine_env())
    R.note_wall("tiny KV cache (preemptions)", run)
    assert run.returncode == 0, run.log[-4000:]
    return run


def test_tiny_kv_every_request_finishes(tiny_kv):
    outs = tiny_kv.extra["outputs"]
    assert len(outs) == N_TINY and all(o["tokens"] == TINY_TOKENS for o in outs)


def test_tiny_kv_preempted_requests_resume_and_finish(tiny_kv):
    ev = R.events(tiny_kv.trace)
    preempt = ev[ev["kind"] == "req_preempt"]
    assert len(preempt) > 0, "16 blocks for 8 running requests of 5 blocks each must preempt"
    last_preempt = preempt.groupby(preempt["req"].astype(str))["ts_ns"].max()
    sched = ev[ev["kind"] == "req_sched"]
    last_sched = sched.groupby(sched["req"].astype(str))["ts_ns"].max()
    assert (last_sched.reindex(last_preempt.index) > last_preempt).all(), "scheduled again after the preemption"
    assert requests_of(ev, "req_finish") == requests_of(ev, "req_add") and len(requests_of(ev, "req_add")) == N_TINY
    frees = ev[ev["kind"] == "blocks_free"]
    assert "preempted" in set(frees["reason"].astype(str))
    sched_rows = ev[ev["component"].astype(str) == "scheduler"]
    alloc = {(str(r), int(b)) for r, bl in zip(sched_rows.loc[sched_rows["kind"] == "blocks_alloc", "req"],
                                                sched_rows.loc[sched_rows["kind"] == "blocks_alloc", "blocks"],
                                                strict=True) for b in bl}
    freed = {(str(r), int(b)) for r, bl in zip(frees["req"], frees["blocks"], strict=True) for b in bl}
    assert alloc <= freed


def test_tiny_kv_resumed_only_after_a_preemption(tiny_kv):
    ev = R.events(tiny_kv.trace)
    preempted = requests_of(ev, "req_preempt")
    adds = ev[ev["kind"] == "batch_add"]
    resumed = set(adds.loc[adds["reason"].astype(str) == "resumed", "req"].astype(str))
    assert resumed, "a preempted request rejoins the persistent batch as resumed"
    assert resumed <= preempted


def test_tiny_kv_no_false_alarm(tiny_kv):
    assert_healthy_findings(tiny_kv.trace)


# ---------------------------------------------------------------------------------------------- 2. worker killed
N_KILL = 16


@pytest.fixture(scope="module")
def worker_killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker_killed")
    spec = {"model": R.tiny_model(root), "requests": N_KILL, "prompt_len": 32, "max_tokens": 900, "pp": 1,
            "max_num_seqs": N_KILL, "kill_worker_after_s": 3}
    run = R.record_offline(root / "trace", spec, R.engine_env())
    R.note_wall("worker rank killed", run)
    return run


def test_worker_killed_the_run_fails(worker_killed):
    assert worker_killed.returncode != 0
    assert "offline_run: killing worker pid" in worker_killed.log and "killing worker pid None" not in worker_killed.log


def test_worker_killed_engine_error_recorded(worker_killed):
    ev = R.events(worker_killed.trace)
    errors = ev[ev["kind"] == "engine_error"]
    assert len(errors) >= 1, "the engine's death is in the trace"
    detail = json.loads(errors["detail"].iloc[0])
    assert detail.get("error") and detail.get("where")


def test_worker_killed_nothing_lost_up_to_the_error(worker_killed):
    ev = R.events(worker_killed.trace)
    assert len(requests_of(ev, "req_add")) == N_KILL
    assert not (ev["kind"].astype(str) == "recorder_off").any()
    error_ts = int(ev.loc[ev["kind"] == "engine_error", "ts_ns"].min())
    sched = ev[(ev["kind"] == "sched")].sort_values("step")
    steps = sched["step"].astype(int).tolist()
    runs = sched["detail"].map(lambda d: json.loads(d).get("empty_run", 1) if isinstance(d, str) else 1).tolist()
    covered = [k for first, n in zip(steps, runs, strict=True) for k in range(first, first + n)]
    assert covered == list(range(len(covered))), "no hole in the steps (a coalesced empty run covers its steps)"
    submitted = set(ev.loc[ev["kind"] == "step_submit", "step"].astype(int))
    assert set(sched.loc[sched["ts_ns"] < error_ts, "step"].astype(int)) <= submitted
    finished_before = requests_of(ev[ev["ts_ns"] <= error_ts], "req_finish")
    assert requests_of(ev, "req_finish") >= finished_before


def test_worker_killed_no_error_finding_blames_the_scheduler(worker_killed):
    code, doc = R.analyze(worker_killed.trace)
    bad = [f for f in doc["findings"] if f["severity"] == "error"]
    assert not bad, json.dumps(bad[:3], indent=1)[:3000]
    for f in doc["findings"]:
        if f["rule"] in ("leaked_blocks", "unscheduled_request") and f["severity"] != "info":
            raise AssertionError(f"not downgraded after the crash: {f}")


# ---------------------------------------------------------------------------------------- 3. the reader never comes
N_A, N_B = 4, 4
LEASE_S = 20  # batch B must still be held at the stop: 3 s of sleep plus the stop (up to 10 s on a loaded machine)


@pytest.fixture(scope="module")
def lonely_prefill(tmp_path_factory):
    from test_pd import PREFILL_PARAMS, nixl_server

    root = tmp_path_factory.mktemp("lonely_prefill")
    (root / "trace").mkdir()
    server = nixl_server(root, "prefill", "kv_producer", R.tiny_model(root), {"kv_lease_duration": LEASE_S})
    try:
        server.wait_ready()
        ask = lambda i: server.complete(R.prompt(i, 48), 1, kv_transfer_params=dict(PREFILL_PARAMS))  # noqa: E731
        batch_a = R.parallel_requests(ask, list(range(N_A)))
        time.sleep(LEASE_S + 6)  # past the lease, and the expiry's report (which comes within ~0.1 s of it)
        batch_b = R.parallel_requests(ask, list(range(100, 100 + N_B)))
        time.sleep(3)  # batch B held past `--grace-s 1` by 2 s (the engine steps idly: its rows reach the stop)
    finally:
        server.stop(signal.SIGTERM, group=False)
    run = server.run()
    run.extra.update(batch_a=batch_a, batch_b=batch_b)
    R.note_wall("prefill whose reader never comes", run)
    return run


def _p_requests(run, batch: str) -> set[str]:
    """The engine's ids of a batch: the n-th req_add in time order belongs to the batch sent n-th."""
    ev = R.events(run.trace)
    adds = ev[ev["kind"] == "req_add"].sort_values("ts_ns")["req"].astype(str).tolist()
    return set(adds[:N_A]) if batch == "A" else set(adds[N_A:N_A + N_B])


def test_lonely_prefill_answers_with_transfer_params(lonely_prefill):
    for answer in lonely_prefill.extra["batch_a"] + lonely_prefill.extra["batch_b"]:
        assert not isinstance(answer, Exception), answer
        assert answer["kv_transfer_params"]["remote_block_ids"]


def test_lonely_prefill_lease_expiry_frees_batch_a(lonely_prefill):
    ev = R.events(lonely_prefill.trace)
    a = _p_requests(lonely_prefill, "A")
    assert len(a) == N_A
    fin = ev[(ev["kind"] == "req_finish") & ev["req"].astype(str).isin(a)]
    assert fin["delay_free"].all()
    sent = ev[(ev["kind"] == "kv_send_done") & ev["req"].astype(str).isin(a)]
    assert set(sent["req"].astype(str)) == a, "the lease expiry stands in for the read"
    held_s = (sent.groupby("req")["ts_ns"].min() - fin.groupby("req")["ts_ns"].min()) / 1e9
    assert (held_s >= LEASE_S * 0.8).all(), held_s
    frees = ev[(ev["kind"] == "blocks_free") & ev["req"].astype(str).isin(a)]
    assert set(frees["req"].astype(str)) == a and set(frees["reason"].astype(str)) == {"sent"}


def test_lonely_prefill_batch_b_still_held_by_default(lonely_prefill):
    b = _p_requests(lonely_prefill, "B")
    code, doc = R.analyze(lonely_prefill.trace)
    assert not R.findings_at_least(doc), R.findings_at_least(doc)[:3]
    held = {f["req"] for f in doc["findings"] if f["rule"] == "leaked_blocks" and f["subrule"] == "still_held"}
    assert held == b


def test_lonely_prefill_batch_b_reported_after_the_grace(lonely_prefill):
    b = _p_requests(lonely_prefill, "B")
    code, doc = R.analyze(lonely_prefill.trace, "--grace-s", "1")
    leaked = {f["req"] for f in R.findings_at_least(doc) if f["rule"] == "leaked_blocks"}
    assert b <= leaked
    assert code == (1 if any(f["severity"] == "error" for f in doc["findings"]) else 0)

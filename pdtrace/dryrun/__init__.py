"""`pdtrace record --dry-run`: the installed vLLM's real EngineCore and Scheduler on a simulated cluster.

The real engine loop, scheduler, KV cache manager, block pool and NixlConnector scheduler side run unchanged; only
the workers, the KV transfer engine and the client are simulated (pdtrace/dryrun/executor.py, transfer.py,
sim.py), on a virtual clock. Recording goes through the same hooks as a live run
(`pdtrace.recording.vllm.install_hooks()` after `session.configure(..., source="dryrun", clock=...)`: timestamps and
the hooks' durations, `dur_ns` and `wait_ns`, come from that virtual clock); only what no
real vLLM code runs for here (the workers' exec spans, per-rank transfer reports, the persistent batch) is emitted
by the simulated workers, on the "worker" channel of each instance's recorder.

It runs on every release pdtrace records (`pdtrace.recording.vllm._TABLES`, 0.10.1.1 to 0.33.x), with that
release's own engine loop and semantics; what the dry run itself must do differently per release (constructors, the
executor's replies, NIXL's metadata, one request id on P and D before 0.28) is in pdtrace/dryrun/compat.py.

Importing this package does not import vLLM: `DryRunConfig` is usable without it; `run_dry_run` imports vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdtrace.dryrun.config import FAULTS, INSTANCE_LAYOUTS, DryRunConfig, offload_supported, parse_length_distribution
from pdtrace.errors import RecordingError, UsageError

#: The newest release the dry run was written against (what differs between releases: docs/vllm-releases.md).
SUPPORTED_VLLM = "0.33.0"

__all__ = [
    "FAULTS",
    "INSTANCE_LAYOUTS",
    "SUPPORTED_VLLM",
    "offload_supported",
    "DryRunConfig",
    "DryRunResult",
    "parse_length_distribution",
    "run_dry_run",
]


@dataclass
class DryRunResult:
    """What a dry run did. `error` is set when vLLM itself raised (the trace is kept and ends with engine_error)."""

    output_dir: Path
    steps: int
    requests: int  # workload requests
    requests_finished: int  # finishes seen by the client/proxy (P and D finishes both count)
    events: int  # rows written
    error: str | None = None
    instances: list[str] = field(default_factory=list)
    virtual_s: float = 0.0
    wall_s: float = 0.0
    engine_steps: dict[str, int] = field(default_factory=dict)
    injected: list[str] = field(default_factory=list)
    traceback: str | None = None  # vLLM's traceback, when it raised
    offload_jobs: dict[str, int] = field(default_factory=dict)  # --instances offload: stores and loads submitted


#: Environment of the process that runs the engines (set in the child, never in the caller's process).
_ENV_DEFAULTS = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # The simulated workers behave like the V1 model runner (persistent batch); say so to vLLM's config too.
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}


def _check_vllm() -> str:
    """The installed vLLM release, if pdtrace has a hook table for it; else RecordingError."""
    # lazy: the CLI imports this package at start (via dryrun.config); no hook tables then
    from pdtrace.recording.vllm import installed_vllm_version, supported_versions, table_for

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RecordingError("the dry run needs vLLM (install pdtrace[vllm] with the CPU recipe of "
                             f"README.md): {exc}") from None
    version = installed_vllm_version() or "unknown"
    entry = table_for(version)
    if entry is None:
        raise RecordingError(f"the dry run drives the vLLM releases pdtrace records ({', '.join(supported_versions())}"
                             f"); this is vLLM {version}")
    return version


def _count_rows(output_dir: Path) -> int:
    import pyarrow.parquet as pq  # lazy: `import pdtrace.dryrun` (the dry run's child, its server) loads no pyarrow

    total = 0
    for p in output_dir.rglob("*.parquet"):
        if any(part.startswith(("_", ".")) for part in p.relative_to(output_dir).parts):
            continue
        total += pq.ParquetFile(p).metadata.num_rows
    return total


def _run_in_child(config: DryRunConfig, out: Path, spawn: Any = None) -> DryRunResult:
    _check_vllm_importable()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdtrace-dryrun-") as tmp:
        cfg_path, res_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps(config.to_dict()))
        env = {**_ENV_DEFAULTS, **os.environ, "PYTHONHASHSEED": "0"}
        # The child imports this very pdtrace, installed or not.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        returncode, stderr = (spawn or _spawn_child)([str(cfg_path), str(out), str(res_path)], env)
        if returncode != 0 or not res_path.exists():
            tail = stderr.strip().splitlines()[-1:] or ["no output"]
            raise RecordingError(f"the dry run's process failed (exit {returncode}): {tail[0]}")
        noise = _child_noise(stderr)
        if noise and spawn is None:  # a caller with its own spawner (pdtrace chaos) reports runs its own way
            sys.stderr.write(noise)
        data = json.loads(res_path.read_text())
    if data.get("usage_error"):
        raise UsageError(data["usage_error"])
    if data.get("recording_error"):
        raise RecordingError(data["recording_error"])
    data["output_dir"] = Path(data["output_dir"])
    return DryRunResult(**data)


def _spawn_child(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `python -m pdtrace.dryrun._child ARGS` with `env` and wait: (its exit status, its stderr). vLLM logs on
    stdout; the child's stdout goes to our stderr (stdout is for results). The one place the dry run starts its
    process (the vLLM test tier swaps in a server that imports vLLM once per test worker and forks per run)."""
    proc = subprocess.run([sys.executable, "-m", "pdtrace.dryrun._child", *args], env=env,
                          stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    return proc.returncode, proc.stderr or ""


#: What vLLM always says on this CPU-only install (no vllm._C, no NIXL, no Triton): not worth a user's attention.
_KNOWN_NOISE = ("Failed to import from vllm._C", "NIXL is not available", "NIXL agent config is not available",
                "Triton not available", "Initializing KVConnectorBase_V1")


def _child_noise(text: str) -> str:
    """The child's stderr without vLLM's known start-up chatter on a CPU-only box."""
    lines = [ln for ln in text.splitlines(keepends=True) if not any(k in ln for k in _KNOWN_NOISE)]
    return "".join(lines)


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except Exception:
        return False


def _check_vllm_importable() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise RecordingError("the dry run needs vLLM (install pdtrace[vllm] with the CPU recipe of README.md)")


def run_dry_run(config: DryRunConfig, output_dir: str | os.PathLike, in_process: bool | None = None,
                spawn: Any = None) -> DryRunResult:
    """Run vLLM's real engine core(s) on the simulated cluster `config` describes; write the trace to `output_dir`.

    Same config and seed: the same events (ts_ns, seq and every field but pid). Raises RecordingError when vLLM is
    missing or another version, UsageError for a bad config, and RecordingError if `output_dir` already holds a
    trace. An exception raised by vLLM during the run is not raised: it is in `result.error` and in the trace.

    vLLM iterates sets of request ids (finished_sending, finished_req_ids...), whose order depends on Python's
    string hashing; so the run happens in a child process with PYTHONHASHSEED=0 unless this process already has
    hash randomization off (`in_process=None`). The child also keeps EngineCore's process-wide side effects
    (gc.freeze, vLLM's environment cache) out of the caller. `spawn` starts that child (default `_spawn_child`, a
    fresh interpreter; `pdtrace.dryrun.zygote.spawn` forks it from a server that imported vLLM once).
    """
    config.validate()
    out = Path(output_dir)
    if out.exists() and any(out.rglob("*.parquet")):
        raise RecordingError(f"{out} already holds a trace; choose an empty or new directory")
    if in_process is None:
        in_process = spawn is None and sys.flags.hash_randomization == 0
    if not in_process:
        return _run_in_child(config, out, spawn)
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    vllm_version = _check_vllm()
    # lazy: the CLI imports this package at start; the simulator loads when a dry run starts
    from pdtrace.dryrun.faults import reshape_workload
    # lazy: the CLI imports this package at start; the simulator loads when a dry run starts
    from pdtrace.dryrun.perturb import apply_to_workload
    # lazy: the CLI imports this package at start; the simulator loads when a dry run starts
    from pdtrace.dryrun.sim import SimCluster
    # lazy: the CLI imports this package at start; the simulator loads when a dry run starts
    from pdtrace.dryrun.workload import make_workload
    # lazy: the CLI imports this package at start; the simulator loads when a dry run starts
    from pdtrace.recording import session
    # lazy: the CLI imports this package at start; no hook tables then
    from pdtrace.recording.vllm import install_hooks, table_for

    wall0 = time.perf_counter()
    workload = make_workload(config)
    reshape_workload(config, workload)
    apply_to_workload(config.perturbations, workload)
    cluster = SimCluster(config, workload)
    out.mkdir(parents=True, exist_ok=True)
    session.configure(str(out), source="dryrun", clock=cluster.clock)
    if not install_hooks():
        raise RecordingError("pdtrace's vLLM hooks could not be installed for this vLLM version")
    try:
        cluster.build()
        stats = cluster.run()
    finally:
        session.close_all()
    manifest = out / "_manifest.json"
    if not manifest.exists():
        manifest.write_text(json.dumps({"command": "pdtrace record --dry-run", "source": "dryrun",
                                        "vllm_version": vllm_version,
                                        "vllm_table": table_for(vllm_version).name,  # type: ignore[union-attr]
                                        "dry_run": config.to_dict()},
                                       indent=1, sort_keys=True) + "\n")
    start = cluster.start_ns
    end = max(e.timeline.now for e in cluster.engines)
    return DryRunResult(output_dir=out, steps=stats.steps, requests=len(workload),
                        requests_finished=stats.requests_finished, events=_count_rows(out), error=stats.error,
                        instances=[e.instance for e in cluster.engines], virtual_s=(end - start) / 1e9,
                        wall_s=time.perf_counter() - wall0, engine_steps=dict(stats.engine_steps),
                        injected=list(cluster.faults.injected) + list(cluster.faults.perturber.injected),
                        traceback=stats.traceback,
                        offload_jobs=({"stores": cluster.offload.stores, "loads": cluster.offload.loads}
                                      if cluster.offload is not None else {}))


def summarize(result: DryRunResult) -> dict[str, Any]:
    """A JSON-friendly summary (for `pdtrace record --dry-run` to print)."""
    d = dict(result.__dict__)
    d["output_dir"] = str(result.output_dir)
    return d

"""vLLM tier: `pdtrace record -o TRACE -- python script.py` end to end, the recorded process being a real
vLLM EngineCore (fake executor) that loads pdtrace through vLLM's plugin loader in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm


def test_record_a_process_running_vllm(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(H.__file__).parent)!r})
        import harness as H
        vc = H.make_vllm_config(H.tiny_model_dir({str(tmp_path)!r}), kv_role=None, pp=2)
        vc.scheduler_config.async_scheduling = False
        engine = H.make_engine(vc, pp=2)
        for i in range(3):
            H.engine_add(engine, H.make_request(f"r{{i}}", 24, max_tokens=4))
        while engine.scheduler.has_requests() or H.engine_busy(engine):
            H.engine_step(engine)
    """))
    trace = tmp_path / "trace"
    proc = subprocess.run([sys.executable, "-m", "pdtrace", "record", "-o", str(trace), "--", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"pdtrace analyze {trace}" in proc.stderr
    manifest = json.loads((trace / "_manifest.json").read_text())
    assert manifest["vllm_version"] == H.release() and manifest["exit_status"] == 0

    import pdtrace

    assert pdtrace.open_trace(trace).sources == [f"vllm-{H.release()}"]  # Parquet metadata written by the recorder
    events = H.read_events(trace)
    assert len({e["pid"] for e in events}) == 1  # one process: the command's EngineCore
    assert len(H.of_kind(events, "req_add")) == 3 and len(H.of_kind(events, "req_finish")) == 3
    sched = H.of_kind(events, "sched")
    steps = [e["step"] for e in sched]
    # 0.10.1.1's step_with_batch_queue updates no empty schedule (no step_output for it).
    updated = steps if H.release_key() >= (0, 10, 2) else [e["step"] for e in sched if e["n"]]
    assert steps == list(range(len(steps))) and [e["step"] for e in H.of_kind(events, "step_output")] == updated


def test_the_dry_run_refuses_a_release_without_a_hook_table(tmp_path, monkeypatch):
    import pdtrace.recording.vllm as hooks
    from pdtrace.dryrun import DryRunConfig, run_dry_run
    from pdtrace.errors import RecordingError

    from pdtrace.dryrun import _ENV_DEFAULTS

    for key, value in _ENV_DEFAULTS.items():  # what an in-process dry run sets, restored after the test
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setattr(hooks, "installed_vllm_version", lambda: "0.9.2")
    with pytest.raises(RecordingError, match=r"dry run drives the vLLM releases pdtrace records \(0\.10\.1\.1 to .*"
                                             r"this is vLLM 0\.9\.2"):
        run_dry_run(DryRunConfig(requests=1), tmp_path / "t", in_process=True)
    assert not (tmp_path / "t").exists()  # refused before anything was written

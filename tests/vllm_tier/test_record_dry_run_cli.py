"""`pdtrace record --dry-run` through the CLI: a shipped sample's REGENERATE command reproduces its findings."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("vllm.version", reason="needs a supported vLLM (.ci/install-vllm.sh VENV [VERSION])")

import harness as H  # noqa: E402

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def _findings(trace: Path, ids=lambda req: req) -> list[tuple]:
    from pdtrace.analysis import analyze

    found = analyze(str(trace))
    return sorted(zip(found["rule"], found["subrule"], found["severity"], found["instance"], found["req"].map(ids)))


@pytest.mark.parametrize("sample", ["starve"])
def test_regenerate_command_reproduces_the_sample(cli, tmp_path: Path, sample: str) -> None:
    folder = REPO / "sample_traces" / sample
    line = next(ln for ln in (folder / "REGENERATE").read_text().splitlines() if ln.startswith("pdtrace record"))
    args = shlex.split(line)[2:]  # after `pdtrace record`
    out = tmp_path / "trace"
    args[args.index("-o") + 1] = str(out)
    result = cli("record", *args)
    assert result.exit_code == 0, result.stderr
    assert f"pdtrace analyze {out}" in result.stderr
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["dry_run"]["faults"] == [sample]
    from pdtrace.recording.vllm import table_for

    table = table_for(H.release()).name
    assert (manifest["vllm_version"], manifest["vllm_table"]) == (H.release(), table)
    assert f"pdtrace: vLLM {H.release()}, hook table {table}" in result.stderr
    assert _findings(out) == _findings(folder, H.sample_req)  # the sample's ids as this release names them

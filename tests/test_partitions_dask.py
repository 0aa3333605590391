"""`pdtrace analyze --dask` / `analyze(path, dask=...)` on a LocalCluster of two worker processes on loopback: the
same report as the whole-trace analysis; a bad partition is one line and exit 2 from inside a Dask task; without
the extra, a one-line hint and exit 2. Dask is part of the `test` extra, so this runs in the core tier."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from distributed import Client, LocalCluster

from pdtrace.analysis import analyze
from pdtrace.trace.builder import write_table
from test_partitions import cross_instance_trace, report


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster, set_as_default=False) as client:
        # nobody's default client, as in a user's process: a fallback to the default client fails here
        # (tests/test_dask_cli_process.py runs the CLI itself in a process of its own)
        yield client


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    write_table(cross_instance_trace().table, tmp_path / "trace")
    return tmp_path / "trace"


def test_dask_gives_the_whole_trace_report(client, trace_dir: Path) -> None:
    whole = analyze(trace_dir, partitioned=False)
    on_cluster = analyze(trace_dir, dask=client)
    assert report(on_cluster, trace_dir) == report(whole, trace_dir)
    assert set(on_cluster["subrule"]) >= {"remote_read", "stuck_waiting_kv"}  # phase 2 ran on the cluster too
    assert sorted(on_cluster.attrs["partitions"]) == ["D0", "D1", "E", "P0", "P1"]
    # a URL: the workers open it through pyarrow's filesystems (file:// here, s3:// or any fsspec protocol there)
    by_url = analyze(trace_dir.resolve().as_uri(), dask=client)
    assert report(by_url, trace_dir) == report(whole, trace_dir)


def test_cli_dask_address(client, trace_dir: Path, cli) -> None:
    address = client.scheduler.address
    res = cli("analyze", trace_dir, "--format", "json", "--dask", address, "--fail-on", "never")
    assert res.exit_code == 0, res.stderr
    whole = cli("analyze", trace_dir, "--format", "json", "--whole", "--fail-on", "never")
    assert json.loads(res.stdout) == json.loads(whole.stdout)
    assert "D1" in res.stderr  # progress per partition on stderr


def test_a_bad_partition_in_a_dask_task_is_one_line(client, trace_dir: Path, cli) -> None:
    """seq going backwards inside one file is found only when a task reads the rows."""
    victim = next((trace_dir / "D1").rglob("*.parquet"))
    table = pq.read_table(victim)
    seq = table.column("seq").to_pylist()
    seq[1], seq[2] = seq[2], seq[1]
    table = table.set_column(table.schema.get_field_index("seq"), "seq", pa.array(seq, table.schema.field("seq").type))
    pq.write_table(table, victim)
    res = cli("analyze", trace_dir, "--dask", client.scheduler.address)
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("pdtrace: error:")]
    assert len(errors) == 1 and "seq" in errors[0] and "D1" in errors[0], res.stderr


def test_a_url_nothing_can_open_is_one_line(cli) -> None:
    res = cli("analyze", "nosuchscheme://bucket/trace")
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("pdtrace: error: nosuchscheme://bucket/trace: cannot open this URL")
    assert len(res.stderr.strip().splitlines()) == 1


def test_without_the_extra_dask_is_a_hint(trace_dir: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    res = cli("analyze", trace_dir, "--dask", "tcp://127.0.0.1:1")
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == ["pdtrace: error: --dask needs the optional Dask extra: pip install "
                                               "'pdtrace[dask]'"]

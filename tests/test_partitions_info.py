"""info, plot and export on a multi-instance trace read only what they need: `info` of a large trace from the
footers (the same values where the footers hold them), `info --rows` one instance at a time (the same summary as
one load), and `--instance` only that instance's part files (the same figure or export as a whole load)."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from pdtrace.analysis.context import AnalysisContext
from pdtrace.trace.builder import write_table
from pdtrace.trace.reader import open_trace
from test_partitions import cross_instance_trace


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    return write_table(cross_instance_trace().table, tmp_path / "trace")


def info_json(cli, *args) -> dict:
    res = cli("info", *args, "--format", "json")
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def test_info_of_a_large_trace_reads_only_footers(trace_dir: Path, cli) -> None:
    full = info_json(cli, trace_dir)  # small: every row, as before
    assert full["rows_read"] is True
    # (mock.patch, not monkeypatch: the cli fixture undoes monkeypatch after each call)
    with mock.patch("pdtrace.analysis.partitions.PARTITION_MIN_EVENTS", 0):  # now it counts as large
        with mock.patch("pdtrace.trace.reader._read_files", side_effect=AssertionError("info read rows")):
            footers = info_json(cli, trace_dir)
            table = cli("info", trace_dir)
        rows = info_json(cli, trace_dir, "--rows")
    assert footers["rows_read"] is False
    for key in ("trace", "events", "files", "skipped_files", "dropped_events", "sources", "schema_versions",
                "pdtrace_versions", "time", "manifest"):
        assert footers[key] == full[key], key
    assert footers["kinds"] is None and footers["requests"] is None and footers["schedulers"] is None
    # one writer per file: names, roles, pids, ranks and events per instance are exact
    for mine, theirs in zip(footers["instances"], full["instances"], strict=True):
        assert {**mine, "requests": theirs["requests"]} == theirs
    assert table.exit_code == 0 and "from the Parquet footers only" in table.stdout
    # --rows: every row, one instance at a time, merged into exactly the one-load summary
    assert rows == full


def test_info_of_one_instance(trace_dir: Path, cli) -> None:
    full = info_json(cli, trace_dir)
    one = info_json(cli, trace_dir, "--instance", "D1")
    assert [i["instance"] for i in one["instances"]] == ["D1"]
    assert one["instances"][0] == next(i for i in full["instances"] if i["instance"] == "D1")
    assert one["events"] == one["instances"][0]["events"]


def test_export_of_one_instance_reads_only_its_files(trace_dir: Path, tmp_path: Path, cli) -> None:
    from pdtrace.export import export as run_export
    from pdtrace.plot import Window

    victim = next((trace_dir / "P1").rglob("*.parquet"))
    victim.write_bytes(victim.read_bytes()[:-20])  # truncated: whoever reads it warns
    whole = cli("export", trace_dir, "-o", tmp_path / "all.json")
    assert whole.exit_code == 0 and "skipped" in whole.stderr
    res = cli("export", trace_dir, "--instance", "D1", "-o", tmp_path / "d1.json")
    assert res.exit_code == 0, res.stderr
    assert "skipped" not in res.stderr  # P1's files were not opened for their rows
    # the same document as exporting D1 from the whole trace
    run_export(AnalysisContext(open_trace(trace_dir, warn=False)), "chrome", tmp_path / "ref.json",
               window=Window(instances=("D1",)), trace_name=str(trace_dir))
    assert json.loads((tmp_path / "d1.json").read_text()) == json.loads((tmp_path / "ref.json").read_text())
    res = cli("plot", trace_dir, "--kind", "steps", "--instance", "nope", "-o", tmp_path / "x.png")
    assert res.exit_code == 2 and "nothing to show" in res.stderr


def test_info_rows_reads_an_instance_in_groups_of_files(tmp_path: Path, cli) -> None:
    """`info --rows` holds a group of an instance's files at a time (an instance of hours does not fit): with
    groups of one small file each, a request's rows span several groups, and the merged summary is still the one
    load's (requests counted once, each scheduler's steps summed, its first and last step kept)."""
    trace_dir = write_table(cross_instance_trace().table, tmp_path / "trace", rows_per_file=2)
    full = info_json(cli, trace_dir)
    assert max(len(list(d.rglob("*.parquet"))) for d in trace_dir.iterdir() if d.is_dir()) > 3
    groups: list[int] = []
    from pdtrace.trace import summary

    real = summary.file_groups

    def one_file_each(files, rows_of, most):
        out = real(files, rows_of, 1)
        groups.append(len(out))
        return out

    with mock.patch("pdtrace.analysis.partitions.PARTITION_MIN_EVENTS", 0), \
            mock.patch("pdtrace.trace.summary.file_groups", one_file_each):
        rows = info_json(cli, trace_dir, "--rows")
    assert groups and max(groups) > 3
    assert rows == full


def test_info_rows_lists_a_file_it_cannot_decode_as_skipped_as_one_load_does(tmp_path: Path, cli) -> None:
    """A part file with a corrupt data page under an intact footer: the one-load summary counts it skipped, not
    loaded; so must the merged `--rows` summary (it counted it loaded, from the footers)."""
    from test_partitions import corrupt_data_pages

    trace_dir = write_table(cross_instance_trace().table, tmp_path / "trace", rows_per_file=2)
    victim = sorted((trace_dir / "D1").rglob("*.parquet"))[1]
    corrupt_data_pages(victim)
    full = info_json(cli, trace_dir)
    assert [s["path"] for s in full["skipped_files"]] == [str(victim)]
    with mock.patch("pdtrace.analysis.partitions.PARTITION_MIN_EVENTS", 0):
        rows = info_json(cli, trace_dir, "--rows")
    assert rows == full


def test_info_of_one_instance_is_the_summary_of_its_files_loaded_at_once(tmp_path: Path, cli) -> None:
    """`info --instance` reads the instance's files in groups (one file each here) and gives what one load of
    those files gives, every key."""
    from pdtrace.analysis.partitions import open_instances
    from pdtrace.trace.summary import summarize

    trace_dir = write_table(cross_instance_trace().table, tmp_path / "trace", rows_per_file=2)
    one_load = summarize(open_instances(trace_dir, ["D1"])[0])
    with mock.patch("pdtrace.analysis.windows.DEFAULT_WINDOW_EVENTS", 1):
        got = info_json(cli, trace_dir, "--instance", "D1")
    assert got == json.loads(json.dumps(one_load))
    assert got["files"] > 3


def test_plot_and_export_refuse_a_load_that_would_not_fit(trace_dir: Path, tmp_path: Path, cli) -> None:
    """plot and export hold every event they show: where the footers' rows need more than the memory available,
    one line and exit 2 before reading a row, rather than the kernel's OOM killer; --instance counts only its
    partitions (and their peers'); --no-memory-check loads anyway."""
    from pdtrace.cli.app import LOAD_EVENT_BYTES

    events = open_trace(trace_dir, warn=False).table.num_rows
    d1 = open_trace(trace_dir, instances=["D1"], warn=False).table.num_rows
    budget = (events - 1) * LOAD_EVENT_BYTES  # one event short of the whole trace
    with mock.patch("pdtrace.cli.app.available_memory", return_value=budget), \
            mock.patch("pdtrace.trace.reader._read_files", side_effect=AssertionError("rows read")):
        for verb, out in (("plot", tmp_path / "x.png"), ("export", tmp_path / "x.json")):
            res = cli(verb, trace_dir, "-o", out)
            assert res.exit_code == 2, res.stderr
            assert "events to load" in res.stderr and "--no-memory-check" in res.stderr
            assert len(res.stderr.strip().splitlines()) == 1
    with mock.patch("pdtrace.cli.app.available_memory", return_value=budget):
        assert cli("export", trace_dir, "-o", tmp_path / "y.json", "--no-memory-check").exit_code == 0
        assert d1 < events
        assert cli("export", trace_dir, "--instance", "D1", "-o", tmp_path / "z.json").exit_code == 0
    with mock.patch("pdtrace.cli.app.available_memory", return_value=None):  # unknown (not Linux): no check
        assert cli("plot", trace_dir, "--kind", "steps", "-o", tmp_path / "w.png").exit_code == 0


def test_available_memory_is_what_the_kernel_says_here() -> None:
    from pdtrace.cli.app import available_memory

    found = available_memory()
    assert found is None or found > 0
    if Path("/proc/meminfo").exists():
        assert found is not None

"""seq order within a writer's part file and the kind/component pairing: the validator names file, row, column,
expected and found; `pdtrace info` and `pdtrace analyze` turn it into one line and exit 2; healthy traces (the
shipped samples, a trace with a reused pid folder) load clean."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pdtrace.errors import TraceError
from pdtrace.format import COMPONENTS, KINDS, file_metadata
from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.reader import open_trace
from pdtrace.trace.validate import check_values, first_seq_violation, validate_table

START = 1_700_000_000_000_000_000
SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def one_writer() -> EventBuilder:
    """One scheduler writer (pid 100) with 8 events, one worker writer (pid 101) with 2."""
    b = EventBuilder(instance="P", role="prefill", pid=100, start_ns=START)
    b.add("engine_config", n=64)
    b.add("req_add", req="r1", n=16)
    b.add("sched", step=0, n=16)
    b.add("req_sched", step=0, req="r1", n=16)
    b.add("blocks_alloc", step=0, req="r1", blocks=[1, 2])
    b.add("exec_begin", pid=101, step=0, pp_rank=0, tp_rank=0, n=16)
    b.add("exec_end", pid=101, step=0, pp_rank=0, tp_rank=0, n=16)
    b.add("step_output", step=0)
    b.add("req_finish", step=0, req="r1", reason="stop", status="RUNNING", delay_free=False)
    b.add("blocks_free", step=0, req="r1", blocks=[1, 2], reason="finished", deferred=False)
    return b


def set_column(table: pa.Table, name: str, values: list) -> pa.Table:
    index = table.schema.get_field_index(name)
    field = table.schema.field(name)
    array = pa.array(values, pa.string()).dictionary_encode() if pa.types.is_dictionary(field.type) \
        else pa.array(values, field.type)
    return table.set_column(index, pa.field(name, array.type, field.nullable), array)


def error_of(table: pa.Table) -> str:
    with pytest.raises(TraceError) as info:
        validate_table(table, where="t.parquet")
    message = str(info.value)
    assert "\n" not in message
    return message


def rewrite(path: Path, edit) -> Path:
    """Rewrite one part file through `edit(table) -> table`, keeping its pdtrace metadata."""
    table = pq.read_table(path)
    pq.write_table(edit(table).replace_schema_metadata(table.schema.metadata), path)
    return path


# ---- seq: the validator ---------------------------------------------------------------------------------------------


def test_builder_tables_are_in_seq_order_per_writer_and_pass():
    table = one_writer().table()
    # The builder numbers each writer (instance, pid) from 0 in the order the events were added: the worker's
    # rows sit between the scheduler's, and seq restarts at each change of writer.
    assert table.column("seq").to_pylist() == [0, 1, 2, 3, 4, 0, 1, 5, 6, 7]
    assert validate_table(table, where="t.parquet") == []


def test_seq_going_backwards_names_row_expected_and_found():
    table = one_writer().table()
    seq = table.column("seq").to_pylist()
    seq[3], seq[4] = seq[4], seq[3]  # rows 3 and 4 swapped: 0 1 2 4 3
    message = error_of(set_column(table, "seq", seq))
    assert message == ("t.parquet: row 4, column 'seq': expected more than 4 (the previous row's seq: seq strictly "
                       "increases within a writer's file), found 3")


def test_a_repeated_seq_is_a_violation():
    table = one_writer().table()
    seq = table.column("seq").to_pylist()
    seq[2] = seq[1]  # a duplicated row
    assert "row 2, column 'seq': expected more than 1" in error_of(set_column(table, "seq", seq))


def test_seq_going_backwards_across_a_writer_change_is_allowed_but_not_within_one():
    table = one_writer().table()
    # Row 5 is the worker's first row (seq 0 after the scheduler's 4): a writer change, allowed.
    assert first_seq_violation(table, "t") is None
    pids = table.column("pid").to_pylist()
    pids[5] = pids[6] = 100  # the worker rows now claim the scheduler's pid: 4 then 0 is backwards
    message = error_of(set_column(table, "pid", pids))
    assert message.startswith("t.parquet: row 5, column 'seq': expected more than 4") and message.endswith("found 0")


def test_a_violation_in_a_later_chunk_or_at_a_chunk_boundary_is_found():
    table = one_writer().table()
    seq = table.column("seq").to_pylist()
    chunked = pa.Table.from_batches(set_column(table, "seq", seq).to_batches(max_chunksize=3))
    assert chunked.column("seq").num_chunks > 1 and first_seq_violation(chunked, "t") is None
    seq[3] = 2  # row 3 starts the second chunk of 3 rows: compared with the last row of the first
    bad = pa.Table.from_batches(set_column(table, "seq", seq).to_batches(max_chunksize=3))
    assert first_seq_violation(bad, "t")[0] == 3
    seq = table.column("seq").to_pylist()
    seq[8] = 1  # inside the third chunk
    bad = pa.Table.from_batches(set_column(table, "seq", seq).to_batches(max_chunksize=3))
    assert first_seq_violation(bad, "t")[0] == 8


def test_file_starts_allow_a_restart_only_where_a_file_begins():
    b = EventBuilder(instance="P", pid=100, start_ns=START)
    for step in range(3):
        b.add("sched", step=step, n=1)
    first = b.table()
    two_files = pa.concat_tables([first, first])  # one writer, seq 0 1 2 0 1 2: a reused pid folder
    with pytest.raises(TraceError, match=r"^t: row 3, column 'seq': expected more than 2"):
        check_values(two_files, "t")
    assert check_values(two_files, "t", file_starts=[3]) == []
    with pytest.raises(TraceError, match="row 3, column 'seq'"):
        check_values(two_files, "t", file_starts=[2])  # a boundary elsewhere does not excuse row 3
    assert check_values(two_files, "t", check_seq=False) == []


def test_seq_is_not_checked_when_not_loaded():
    table = one_writer().table()
    seq = table.column("seq").to_pylist()
    seq[2] = 0
    bad = set_column(table, "seq", seq)
    assert check_values(bad.drop_columns(["seq"]), "t") == []


# ---- component: the validator ---------------------------------------------------------------------------------------


def test_kinds_table_gives_every_fixed_kind_a_component_of_the_format():
    for kind, allowed in KINDS.items():
        assert allowed is None or (allowed and allowed <= COMPONENTS), kind
    assert KINDS["sched"] == {"scheduler"} and KINDS["step_submit"] == {"engine"}
    assert KINDS["exec_begin"] == {"worker", "connector"} and KINDS["recorder_gap"] is None


@pytest.mark.parametrize("row,component,allowed", [
    (5, "scheduler", "one of connector, worker"),  # exec_begin written as if by the scheduler
    (7, "worker", "one of engine"),  # step_output is the engine loop's
    (2, "engine", "one of scheduler"),  # sched is the scheduler's
])
def test_a_kind_on_a_component_the_format_does_not_allow_is_named(row, component, allowed):
    table = one_writer().table()
    components = table.column("component").to_pylist()
    components[row] = component
    kind = table.column("kind")[row].as_py()
    message = error_of(set_column(table, "component", components))
    assert message == (f"t.parquet: row {row}, column 'component': expected {allowed} for kind '{kind}', "
                       f"found '{component}'")


def test_recorder_and_unknown_kinds_may_come_from_any_component():
    b = one_writer()
    b.add("recorder_gap", component="worker", pid=101, pp_rank=0, tp_rank=0, n=3)
    b.add("recorder_off", component="engine", detail={"error": "x"})
    b.add("kv_heartbeat", component="connector", pid=101, req="r1")
    b.add("kv_teleport", component="worker", pid=101, req="r1")  # a kind from a newer format: a note only
    notes = validate_table(b.table(), where="t")
    assert len(notes) == 1 and "kv_teleport" in notes[0]


def test_the_lowest_row_wins_between_a_component_and_a_seq_violation():
    table = one_writer().table()
    components = table.column("component").to_pylist()
    components[6] = "scheduler"  # exec_end on the scheduler
    seq = table.column("seq").to_pylist()
    seq[8] = 0  # req_finish going backwards
    table = set_column(set_column(table, "component", components), "seq", seq)
    assert "row 6, column 'component'" in error_of(table)
    seq = table.column("seq").to_pylist()
    seq[2] = 0
    assert "row 2, column 'seq'" in error_of(set_column(table, "seq", seq))


# ---- the reader: file and row named, restarts between files allowed -------------------------------------------------


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    """The scheduler writer P/100 (seq 0..7) in 4 part files of 2 rows, the worker writer P/101 in 1 file."""
    return one_writer().write(tmp_path / "trace", rows_per_file=2)


def swap_seq(path: Path) -> Path:
    return rewrite(path, lambda t: set_column(t, "seq", t.column("seq").to_pylist()[::-1]))


def test_healthy_multi_file_trace_loads_clean_with_and_without_filters(trace_dir):
    assert len(list((trace_dir / "P" / "100").glob("*.parquet"))) == 4
    assert len(open_trace(trace_dir, warn=False)) == 10
    assert len(open_trace(trace_dir, instances="P", warn=False)) == 10
    assert len(open_trace(trace_dir, since_ns=START + 2_000, warn=False)) == 8


def test_open_trace_names_the_file_and_the_row_within_it(trace_dir):
    bad = swap_seq(trace_dir / "P" / "100" / "part-000002.parquet")  # seq 4, 5 -> 5, 4
    with pytest.raises(TraceError) as info:
        open_trace(trace_dir, warn=False)
    assert str(info.value) == (f"{bad}: row 1, column 'seq': expected more than 5 (the previous row's seq: seq "
                               "strictly increases within a writer's file), found 4")
    # A filtered load does not know where each file's rows start in the table, and still names the file.
    with pytest.raises(TraceError, match=f"^{bad}: row 1, column 'seq'"):
        open_trace(trace_dir, instances="P", warn=False)
    with pytest.raises(TraceError, match=f"^{bad}: row 1, column 'seq'"):
        open_trace(trace_dir, since_ns=START + 1_000, warn=False)
    assert len(open_trace(trace_dir, validate=False, warn=False)) == 10  # still loadable on request


def test_a_reused_pid_folder_restarts_seq_between_files_and_loads_clean(tmp_path):
    """A later process with the same pid continues the folder's part numbers with its own seq from 0 (the
    recorder's `_claim_part`): seq goes 0..7 in the first files, then 0..2 again."""
    trace_dir = one_writer().write(tmp_path / "trace", rows_per_file=2)
    again = EventBuilder(instance="P", role="prefill", pid=100, start_ns=START + 10**9)
    for step in range(3):
        again.add("sched", step=step, n=0)
    table = again.table().replace_schema_metadata(file_metadata("t", "synthetic", 0))
    pq.write_table(table, trace_dir / "P" / "100" / "part-000004.parquet")
    assert len(open_trace(trace_dir, warn=False)) == 13
    assert len(open_trace(trace_dir, instances=["P"], warn=False)) == 13
    assert len(open_trace(trace_dir, until_ns=START + 2 * 10**9, warn=False)) == 13


def test_wrong_component_names_the_file_and_row(trace_dir):
    def worker_as_scheduler(table: pa.Table) -> pa.Table:
        return set_column(table, "component", ["worker", "scheduler"])

    bad = rewrite(trace_dir / "P" / "101" / "part-000000.parquet", worker_as_scheduler)
    with pytest.raises(TraceError) as info:
        open_trace(trace_dir, warn=False)
    assert str(info.value) == (f"{bad}: row 1, column 'component': expected one of connector, worker for kind "
                               "'exec_end', found 'scheduler'")


# ---- the CLI: one line, exit 2 ----------------------------------------------------------------------------------


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize("args", [["info"], ["analyze"], ["analyze", "--instance", "P"]])
def test_cli_reports_seq_going_backwards_with_file_and_row(cli, trace_dir, args):
    bad = swap_seq(trace_dir / "P" / "100" / "part-000001.parquet")  # seq 2, 3 -> 3, 2
    line = one_error_line(cli(args[0], trace_dir, *args[1:]))
    assert line == (f"pdtrace: error: {bad}: row 1, column 'seq': expected more than 3 (the previous row's seq: "
                    "seq strictly increases within a writer's file), found 2")


@pytest.mark.parametrize("verb", ["info", "analyze"])
def test_cli_reports_a_wrong_component_with_file_and_row(cli, trace_dir, verb):
    bad = rewrite(trace_dir / "P" / "100" / "part-000001.parquet",
                  lambda t: set_column(t, "component", ["scheduler", "engine"]))  # req_sched on the engine
    line = one_error_line(cli(verb, trace_dir))
    assert line == (f"pdtrace: error: {bad}: row 1, column 'component': expected one of scheduler for kind "
                    "'req_sched', found 'engine'")


def test_cli_loads_the_healthy_trace(cli, trace_dir):
    result = cli("info", trace_dir)
    assert result.exit_code == 0, result.stderr
    assert "error" not in result.stderr


def sample_traces() -> list[Path]:
    return sorted(d / "trace" for d in SAMPLES.iterdir() if (d / "trace").is_dir()) if SAMPLES.is_dir() else []


@pytest.mark.parametrize("trace", sample_traces(), ids=lambda p: p.parent.name)
def test_shipped_samples_load_clean(trace):
    loaded = open_trace(trace, warn=False)
    assert len(loaded) > 0
    assert not any("seq" in w or "component" in w for w in loaded.warnings)
    # and file by file, where each file is the whole table (no boundaries to excuse a restart)
    for part in sorted(trace.rglob("*.parquet")):
        assert check_values(pq.read_table(part), str(part)) == []

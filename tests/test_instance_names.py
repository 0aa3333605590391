"""Readable instance names (issue 36 item 4): a real engine's instance is vLLM's 19-digit `instance_id` or a
connector's uuid `engine_id`; every verb prints `prefill-0`, `decode-0`, `engine-0` instead, the same name
whatever part of the trace it reads, and keeps vLLM's id in `info` and the JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdtrace.analysis import analyze
from pdtrace.analysis.context import AnalysisContext
from pdtrace.analysis.partitions import open_instances, open_window, plan_partitions
from pdtrace.analysis.config import AnalysisConfig
from pdtrace.plot import Window, build_figure
from pdtrace.trace.builder import EventBuilder
from pdtrace.trace.names import is_generated, names_of, readable_names, resolve_instance
from pdtrace.trace.reader import footer_names, open_trace, read_footers
from renamed import ID_D, ID_P, UUID, renamed

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
PD = {"prefill-0": UUID, "decode-0": ID_D}  # a NIXL prefill side (uuid engine_id), a decode side's instance_id


@pytest.fixture(scope="module")
def pd_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """slow_transfer (a P/D pair with a leak and a stuck receive) as a real engine names its instances."""
    return renamed(SAMPLES / "slow_transfer" / "trace", tmp_path_factory.mktemp("names") / "pd", PD)


@pytest.fixture(scope="module")
def engines_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two engines without a connector (role none), 19-digit ids whose order is not their start order: the one
    that starts first (the old prefill side) has the larger id."""
    return renamed(SAMPLES / "slow_transfer" / "trace", tmp_path_factory.mktemp("names") / "engines",
                   {"prefill-0": ID_D, "decode-0": ID_P}, roles={"prefill-0": "none", "decode-0": "none"})


# ------------------------------------------------------------------------------------------------- the function

def test_generated_ids_are_told_from_given_names():
    for made in (ID_P, UUID, UUID.replace("-", ""), "0a1b2", "12345678"):
        assert is_generated(made), made
    for given in ("prefill-0", "decode-0", "P", "engine-0", "my-prefill", "faced", "vllm"):
        assert not is_generated(given), given


def test_names_by_role_and_first_event_ties_by_id_given_names_kept_and_unique():
    names = readable_names({
        "1796642343414415540": ({"none"}, 30),
        "1796642343414415539": ({"none"}, 10),
        "1796642343414415538": ({"none"}, 10),  # same first event as ...539: the lower id first
        UUID: ({"prefill"}, 50),
        "decode-0": ({"decode"}, 99),           # a name someone gave: kept, and not given twice
        "00000000-0000-4000-8000-000000000001": ({"decode"}, 1),
        "0a1b2": ({"both"}, None),
    })
    assert names == {"1796642343414415538": "engine-0", "1796642343414415539": "engine-1",
                     "1796642343414415540": "engine-2", UUID: "prefill-0", "decode-0": "decode-0",
                     "00000000-0000-4000-8000-000000000001": "decode-1", "0a1b2": "pd-0"}
    assert len(set(names.values())) == len(names)
    assert resolve_instance("engine-1", names) == "1796642343414415539"
    assert resolve_instance("1796642343414415539", names) == "1796642343414415539"
    assert resolve_instance("nope", names) == "nope"


def test_samples_keep_their_names():
    trace = open_trace(SAMPLES / "healthy_pd_pp1" / "trace")
    assert trace.instance_names == {"prefill-0": "prefill-0", "decode-0": "decode-0"}


def test_a_built_trace_is_named_from_its_rows():
    b = EventBuilder(instance=ID_P, role="decode")
    b.add("req_add", req="a", n=4)
    b.add("req_add", req="b", n=4, instance=ID_D, role="prefill")
    assert names_of(b.trace()) == {ID_P: "decode-0", ID_D: "prefill-0"}


# --------------------------------------------------------------------- the same names whatever part is read

def test_every_read_of_the_trace_names_the_instances_alike(engines_trace: Path):
    whole = open_trace(engines_trace).instance_names
    assert whole == {ID_D: "engine-0", ID_P: "engine-1"}  # by first event, not by id
    assert footer_names(read_footers(engines_trace)) == whole
    assert open_trace(engines_trace, instances=[ID_P]).instance_names == whole  # one instance
    start = min(int(v) for v in open_trace(engines_trace).table.column("ts_ns").to_pylist())
    late = open_trace(engines_trace, since_ns=start + 30_000_000)  # a cut after ID_D's first events
    assert late.instance_names == whole
    (part,) = [p for p in plan_partitions(engines_trace).partitions if p.instance == ID_P]
    only = open_trace(engines_trace, only_files=part.files)  # one partition's files, as a worker reads them
    trace, _, _ = open_instances(engines_trace, [ID_P])
    assert names_of(trace) == whole
    window, _ = open_window(engines_trace, [ID_P], start + 30_000_000, None, AnalysisConfig(window_events=200))
    assert names_of(window) == whole
    # the twin: the partition's rows alone would name its one engine engine-0
    assert names_of(only) == {ID_P: "engine-0"}


def test_partitioned_and_windowed_analyses_name_instances_as_the_whole(engines_trace: Path, cli):
    base = ["analyze", engines_trace, "--format", "json", "--fail-on", "never"]
    whole = json.loads(cli(*base, "--whole").stdout)
    parts = json.loads(cli(*base, "--partitions", "--jobs", "1").stdout)
    windowed = cli(*base, "--partitions", "--jobs", "1", "--window-events", "300")
    windows = json.loads(windowed.stdout)
    assert "engine-1 window 1/" in windowed.stderr and ID_P not in windowed.stderr  # progress lines too
    named = {(f["instance"], f["instance_name"]) for f in whole["findings"]}
    assert named == {(ID_D, "engine-0"), (ID_P, "engine-1")}
    for other in (parts, windows):
        assert {(f["instance"], f["instance_name"]) for f in other["findings"]} == named
    for finding in whole["findings"]:
        assert list(finding)[list(finding).index("instance") + 1] == "instance_name"
    only = json.loads(cli(*base, "--instance", "engine-1").stdout)
    assert {(f["instance"], f["instance_name"]) for f in only["findings"]} == {(ID_P, "engine-1")}
    assert cli(*base, "--instance", ID_P).stdout == cli(*base, "--instance", "engine-1").stdout


def test_in_memory_partitioned_analysis_names_as_the_whole(engines_trace: Path):
    trace = open_trace(engines_trace)
    trace.instance_names = None  # an in-memory trace: named from its rows
    whole = analyze(trace, partitioned=False)
    parts = analyze(trace, partitioned=True)
    assert list(whole["instance_name"]) == list(parts["instance_name"])
    assert set(whole["instance_name"]) == {"engine-0", "engine-1"}


# ------------------------------------------------------------------------------------------------- the verbs

def test_analyze_text_prints_names_and_the_ids_once(pd_trace: Path, cli):
    result = cli("analyze", pd_trace)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    (mapping,) = [line for line in lines if " instances: " in line]
    assert f"decode-0 = {ID_D}" in mapping and f"prefill-0 = {UUID}" in mapping
    rest = "\n".join(line for line in lines if line is not mapping)
    assert ID_D not in rest and UUID not in rest
    assert "[prefill-0 dp0]" in rest and "[decode-0 dp0]" in rest
    assert re.search(r"│ prefill-0 +│", rest) and re.search(r"│ decode-0 +│", rest)  # the leak summary


def test_analyze_json_keeps_the_id_and_adds_the_name(pd_trace: Path, cli):
    doc = json.loads(cli("analyze", pd_trace, "--format", "json").stdout)
    pairs = {(f["instance"], f["instance_name"]) for f in doc["findings"]}
    assert pairs == {(UUID, "prefill-0"), (ID_D, "decode-0")}
    assert {e["instance"] for e in doc["summary"]["leaks"]} == {UUID, ID_D}  # the summary keeps the ids


def test_analyze_instance_unknown_lists_names_and_ids(pd_trace: Path, cli):
    result = cli("analyze", pd_trace, "--instance", "decode-9")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"decode-0 ({ID_D})" in result.stderr


def test_show_request_and_step_print_names(pd_trace: Path, cli):
    story = cli("show", pd_trace, "--req", "r00004-d")
    assert story.exit_code == 0
    assert story.stdout.startswith("request r00004-d (prefill-0:r00004-p, decode-0:r00004-d)")
    assert "prefill-0/dp0" in story.stdout and "decode-0/dp0" in story.stdout
    assert '"remote_instance":"prefill-0"' in story.stdout  # the peer in a detail, by its name too
    assert ID_D not in story.stdout and UUID not in story.stdout
    step = cli("show", pd_trace, "--step", "3", "--instance", "decode-0")
    assert step.exit_code == 0 and "update_from_output(3) on decode-0/dp0" in step.stdout
    assert ID_D not in step.stdout and "prefill-0" not in step.stdout
    assert cli("show", pd_trace, "--step", "3", "--instance", ID_D).stdout == step.stdout
    doc = json.loads(cli("show", pd_trace, "--req", "r00004-d", "--format", "json").stdout)
    assert {e["instance"] for e in doc["events"]} == {r["instance"] for r in doc["requests"]} == {UUID, ID_D}
    assert doc["instance_names"] == {UUID: "prefill-0", ID_D: "decode-0"}
    doc = json.loads(cli("show", pd_trace, "--step", "3", "--instance", "decode-0", "--format", "json").stdout)
    assert doc["instance"] == ID_D and doc["instance_names"] == {ID_D: "decode-0"}


def test_info_shows_name_and_vllm_id(pd_trace: Path, cli):
    table = cli("info", pd_trace)
    assert table.exit_code == 0
    assert "vLLM id" in table.stdout
    assert re.search(rf"│ prefill-0 +│ {UUID} +│ prefill", table.stdout)
    assert re.search(rf"│ decode-0 +│ {ID_D} +│ decode", table.stdout)
    doc = json.loads(cli("info", pd_trace, "--format", "json").stdout)
    assert [(i["instance"], i["name"]) for i in doc["instances"]] == [(UUID, "prefill-0"), (ID_D, "decode-0")]
    assert {(s["instance"], s["name"]) for s in doc["schedulers"]} == {(UUID, "prefill-0"), (ID_D, "decode-0")}
    one = json.loads(cli("info", pd_trace, "--format", "json", "--instance", "decode-0").stdout)
    assert [(i["instance"], i["name"]) for i in one["instances"]] == [(ID_D, "decode-0")]
    # a sample's names are its ids: no extra column
    assert "vLLM id" not in cli("info", SAMPLES / "slow_transfer" / "trace").stdout


def _texts(fig) -> str:
    out = [fig._suptitle.get_text() if fig._suptitle is not None else ""]
    for ax in fig.axes:
        out.append(ax.get_title())
        out.extend(t.get_text() for t in ax.get_yticklabels())
        legend = ax.get_legend()
        if legend is not None:
            out.extend(t.get_text() for t in legend.get_texts())
    return "\n".join(out)


@pytest.mark.parametrize("kind", ["pipeline", "requests", "blocks", "steps"])
def test_plot_labels_use_names(pd_trace: Path, kind: str):
    ctx = AnalysisContext(open_trace(pd_trace))
    text = _texts(build_figure(ctx, kind, dpi=40))
    assert "decode-0" in text and ID_D not in text and UUID not in text
    only = _texts(build_figure(ctx, kind, Window(instances=("decode-0",)), dpi=40))
    assert "decode-0" in only and "prefill-0" not in only.replace("instance decode-0", "")


def test_export_process_names(pd_trace: Path, tmp_path: Path, cli):
    out = tmp_path / "t.json"
    assert cli("export", pd_trace, "--to", "chrome", "-o", out).exit_code == 0
    doc = json.loads(out.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    processes = sorted(e["args"]["name"] for e in events if e.get("name") == "process_name")
    assert processes == [f"decode-0 [{ID_D}] (decode)", f"prefill-0 [{UUID}] (prefill)"]
    assert cli("export", pd_trace, "--to", "chrome", "-o", tmp_path / "d.json", "--instance", "decode-0") \
        .exit_code == 0
    events = json.loads((tmp_path / "d.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert [e["args"]["name"] for e in events if e.get("name") == "process_name"] == [f"decode-0 [{ID_D}] (decode)"]

"""`pytest -p pdtrace`: record each test through pdtrace's hooks and fail it when its trace has findings.

pytest loads this module in every run through the `pytest11` entry point named `pdtrace`, so it stays inert
unless asked for: on its own it only adds its command-line options and registers its two markers (so that
`--strict-markers` accepts them either way). It is switched on by `--pdtrace` or by naming it, `-p pdtrace`
(pytest records `-p` arguments in `config.option.plugins`); `-p no:pdtrace` keeps it out entirely. Only then does
`pytest_configure` register the `Recording` object that holds the per-test hooks; pdtrace's recording and analysis
modules are imported then, not before.

Per test, while switched on (the model is pytest-memray):

1. setup: the recording session (`pdtrace.recording.session.configure`) and `PDTRACE_TRACE_DIR` point at the
   test's own directory under `--pdtrace-dir` (default: a fresh temporary directory), so that vLLM processes the
   test starts record there too; the vLLM hook table is installed once per run (`install_hooks`, a no-op without
   vLLM) and switched on with its error count reset.
2. the test runs, fixtures' setup included; its events are written by the hooks (or by anything that emits
   through the session).
3. after the call: the hooks are switched off, the recorders closed (teardown is not recorded), the trace is
   analysed with `pdtrace.analyze`, and the call's report fails when a finding reaches `--pdtrace-fail-on`
   (`error` | `warning` | `info`, default `error`) and is not allowed by `@pytest.mark.pdtrace_allow(...)`. With
   `--pdtrace-report` the findings are attached to the report (a `pdtrace` section) and the outcome is kept.
   A test that already failed keeps its own failure; the findings are added as a section.

Recording never changes a test's outcome by itself: a hook that fails switches recording off for the rest of that
test (counted, as `RUNTIME.fail` does in production), and a recording that cannot start or a trace that cannot be
analysed is counted and reported, never turned into a failure. `@pytest.mark.pdtrace_skip` leaves a test
unrecorded. The terminal summary lists the tests with findings, and `<pdtrace-dir>/summary.json` holds one record
per recorded test (its trace directory, events, findings per severity, the rules of the failing ones, hook errors)
for scripts such as the CI tier.

Under pytest-xdist (`-n N`) each worker records and judges its own tests (a verdict travels back to the controller
in the test's report, as any failure does) under the controller's root, passed in `workerinput`; the controller,
which runs no test, gathers the workers' records from `workeroutput` when each worker ends, and writes the one
summary.json and the summary of all of them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

import pdtrace

PLUGIN_NAME = "pdtrace"
SKIP_MARKER = "pdtrace_skip"
ALLOW_MARKER = "pdtrace_allow"
FAIL_ON_CHOICES = ("error", "warning", "info")
SUMMARY_FILE = "summary.json"
#: Keys of pytest-xdist's workerinput (the controller's trace root) and workeroutput (a worker's records).
_XDIST_ROOT = "pdtrace_root"
_XDIST_RECORDS = "pdtrace_records"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_MAX_NAME = 120


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pdtrace", "pdtrace: record each test through the vLLM hooks and check its trace")
    group.addoption("--pdtrace", action="store_true", default=False,
                    help="record every test into its own trace and fail it on findings (also: -p pdtrace)")
    group.addoption("--pdtrace-dir", default=None, metavar="DIR",
                    help="where the per-test trace directories go (default: a new temporary directory)")
    group.addoption("--pdtrace-fail-on", default="error", choices=FAIL_ON_CHOICES,
                    help="the least severity that fails a test (default: error)")
    group.addoption("--pdtrace-report", action="store_true", default=False,
                    help="only report findings (a report section and the summary); never fail a test")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SKIP_MARKER}: pdtrace does not record this test")
    config.addinivalue_line("markers", f"{ALLOW_MARKER}(*rules): findings of these rules ('rule' or "
                                       "'rule/subrule') never fail this test")
    if is_requested(config):
        config.pluginmanager.register(Recording(config), "pdtrace-recording")


def is_requested(config: pytest.Config) -> bool:
    """`--pdtrace`, or `-p pdtrace` on the command line (or in addopts / PYTEST_ADDOPTS)."""
    return bool(config.getoption("pdtrace")) or PLUGIN_NAME in (config.getoption("plugins", None) or ())


def trace_dir_name(nodeid: str) -> str:
    """A directory name for a test id: unsafe characters replaced, long ids cut and made unique by a hash."""
    name = _UNSAFE.sub("_", nodeid).strip("_") or "test"
    if len(name) > _MAX_NAME:
        name = name[: _MAX_NAME - 13] + "-" + hashlib.sha1(nodeid.encode()).hexdigest()[:12]
    return name


def allowed_rules(item: pytest.Item) -> frozenset[str]:
    """The rules (`rule` or `rule/subrule`) that every `pdtrace_allow` marker of the test names."""
    return frozenset(str(name) for mark in item.iter_markers(ALLOW_MARKER) for name in mark.args)


@dataclass
class RecordedTest:
    """What pdtrace saw of one test (one entry of summary.json)."""

    nodeid: str
    trace: str
    events: int = 0
    findings: dict[str, int] = field(default_factory=dict)  # severity -> count
    failing: list[str] = field(default_factory=list)  # rule/subrule of the findings that reach the level
    allowed: list[str] = field(default_factory=list)  # rule/subrule reaching the level but allowed by marker
    hook_errors: int = 0
    first_hook_error: str | None = None
    pdtrace_error: str | None = None  # pdtrace's own failure: recording could not start, or no analysis
    failed_test: bool = False  # the plugin turned a passing call into a failure


class Recording:
    """The per-test hooks, registered only when pdtrace was asked for."""

    def __init__(self, config: pytest.Config) -> None:
        # lazy: the analysis stack loads only in a run that asked for pdtrace
        from pdtrace.analysis.findings import SEVERITY_ORDER

        self.config = config
        # An xdist worker records under its controller's root, whatever --pdtrace-dir said (it is the same).
        given = getattr(config, "workerinput", {}).get(_XDIST_ROOT) or config.getoption("pdtrace_dir")
        self.root = Path(given).resolve() if given else Path(tempfile.mkdtemp(prefix="pdtrace-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.report_only = bool(config.getoption("pdtrace_report"))
        self.level = SEVERITY_ORDER[config.getoption("pdtrace_fail_on")]
        self.records: list[RecordedTest] = []
        self._current: RecordedTest | None = None
        self._env_before: str | None = None
        self._hooks: bool | None = None  # whether vLLM's hook table is installed (decided at the first test)
        self._owns_hooks = False  # installed by this run (then put back at its end)

    # ------------------------------------------------------------------------------------------ recording

    def _install_hooks(self) -> bool:
        if self._hooks is None:
            # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
            from pdtrace.recording.vllm import hooks_installed, install_hooks, installed_vllm_version

            self._owns_hooks = not hooks_installed()
            self._hooks = installed_vllm_version() is not None and install_hooks()
        return self._hooks

    def _start(self, item: pytest.Item) -> None:
        # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
        from pdtrace.recording import session
        # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
        from pdtrace.recording.vllm import installed_vllm_version
        # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
        from pdtrace.recording.vllm._runtime import RUNTIME

        trace = self.root / trace_dir_name(item.nodeid)
        if trace.exists():  # a rerun into the same --pdtrace-dir: this run's trace only
            shutil.rmtree(trace)
        trace.mkdir(parents=True)  # there from the start, for a test (or a process it starts) to look at
        version = installed_vllm_version()
        session.configure(trace, source=f"vllm-{version}" if version else "pytest")
        self._env_before = os.environ.get(session.TRACE_DIR_ENV)
        os.environ[session.TRACE_DIR_ENV] = str(trace)
        self._install_hooks()
        RUNTIME.reset()  # a hook error switched recording off for the test it happened in, not for the rest
        RUNTIME.active = True
        self._current = RecordedTest(nodeid=item.nodeid, trace=str(trace))

    def _stop(self) -> RecordedTest | None:
        """Switch the hooks off, close the recorders, restore the environment; the test's record."""
        # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
        from pdtrace.recording import session
        # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
        from pdtrace.recording.vllm._runtime import RUNTIME

        rec, self._current = self._current, None
        if rec is None:
            return None
        RUNTIME.active = False
        rec.hook_errors, rec.first_hook_error = RUNTIME.errors, RUNTIME.first_error
        session.reset()
        if self._env_before is None:
            os.environ.pop(session.TRACE_DIR_ENV, None)
        else:
            os.environ[session.TRACE_DIR_ENV] = self._env_before
        self.records.append(rec)
        return rec

    def _analyze(self, rec: RecordedTest, allowed: frozenset[str]) -> tuple[Any, int | None]:
        """The test's findings DataFrame (None when nothing was recorded) and the trace's first time; fills
        `rec`'s counts."""
        # lazy: the analysis stack loads only in a run that asked for pdtrace
        from pdtrace.analysis.findings import SEVERITY_ORDER

        trace = Path(rec.trace)
        if not trace.is_dir() or not any(trace.glob("**/*.parquet")):
            if trace.is_dir() and not any(trace.iterdir()):
                trace.rmdir()
            return None, None
        import pyarrow.compute as pc  # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)

        # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
        from pdtrace.errors import PdtraceError

        try:
            loaded = pdtrace.open_trace(trace)
            rec.events = len(loaded)
            start = pc.min(loaded.table.column("ts_ns")).as_py() if len(loaded) else None
            findings = pdtrace.analyze(loaded)
        except (PdtraceError, OSError) as exc:
            rec.pdtrace_error = f"trace not analysed: {type(exc).__name__}: {exc}"
            return None, None
        rec.findings = {str(k): int(v) for k, v in findings["severity"].value_counts().items()}
        for row in findings[["rule", "subrule", "severity"]].itertuples(index=False):
            if SEVERITY_ORDER.get(str(row.severity), -1) < self.level:
                continue
            name = f"{row.rule}/{row.subrule}"
            target = rec.allowed if (row.rule in allowed or name in allowed) else rec.failing
            if name not in target:
                target.append(name)
        return findings, start

    # ------------------------------------------------------------------------------------------ pytest hooks

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if item.get_closest_marker(SKIP_MARKER) is not None:
            return
        try:
            self._start(item)
        except Exception as exc:  # recording that cannot start must not fail the test
            self._current = self._current or RecordedTest(nodeid=item.nodeid, trace="")
            rec = self._stop()  # the session and PDTRACE_TRACE_DIR as they were
            rec.pdtrace_error = f"recording not started: {type(exc).__name__}: {exc}"

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if call.when != "call" or self._current is None:
            return report
        rec = self._stop()
        try:
            findings, start = self._analyze(rec, allowed_rules(item))
        except Exception as exc:  # an analysis bug must not change the test's outcome
            rec.pdtrace_error = f"trace not analysed: {type(exc).__name__}: {exc}"
            findings = start = None
        if findings is not None and len(findings):
            text = _render(findings, rec.trace, start)
            if rec.failing and report.passed and not self.report_only:
                report.outcome = "failed"
                level = self.config.getoption("pdtrace_fail_on")
                report.longrepr = (f"pdtrace: findings reaching --pdtrace-fail-on={level}: "
                                   f"{', '.join(rec.failing)}\n\n{text}")
                rec.failed_test = True
            else:
                report.sections.append(("pdtrace", text))
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        # Setup failed or skipped: the call never ran; the recording ends here unanalysed.
        self._stop()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._stop()
        if self._hooks and self._owns_hooks:
            # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)
            from pdtrace.recording.vllm import uninstall_hooks

            uninstall_hooks()
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: its records go to the controller, which writes the summary
            workeroutput[_XDIST_RECORDS] = [asdict(r) for r in self.records]
            return
        (self.root / SUMMARY_FILE).write_text(json.dumps([asdict(r) for r in self.records], indent=1))

    # ------------------------------------------------------------------ pytest-xdist (controller side only)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Every worker records under this run's root (--pdtrace-dir, or the controller's temporary directory)."""
        node.workerinput[_XDIST_ROOT] = str(self.root)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """A worker ended: its records join this run's summary (a worker that crashed sends none)."""
        for record in getattr(node, "workeroutput", {}).get(_XDIST_RECORDS, ()):
            self.records.append(RecordedTest(**record))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        records = self.records
        with_events = sum(1 for r in records if r.events)
        off = [r for r in records if r.hook_errors]
        broken = [r for r in records if r.pdtrace_error]
        tr = terminalreporter
        tr.write_sep("=", "pdtrace")
        tr.write_line(f"{len(records)} tests recorded, {with_events} with events, {len(off)} with recording "
                      f"switched off by a hook error, {len(broken)} with a pdtrace error; traces in {self.root}")
        for r in records:
            if r.findings:
                counts = ", ".join(f"{n} {sev}" for sev, n in sorted(r.findings.items()))
                verdict = ("FAILED " if r.failed_test else "") + (", ".join(r.failing) or "-")
                allowed = f" (allowed: {', '.join(r.allowed)})" if r.allowed else ""
                tr.write_line(f"{r.nodeid}: {counts}; reaching the level: {verdict}{allowed}")
        for r in off:
            tr.write_line(f"{r.nodeid}: recording off after {r.hook_errors} hook error(s): {r.first_hook_error}")
        for r in broken:
            tr.write_line(f"{r.nodeid}: {r.pdtrace_error}")


def _render(findings: Any, trace: str, start_ns: int | None) -> str:
    """The memcheck-shaped report of `pdtrace analyze`, as plain text."""
    from rich.console import Console  # lazy: the plugin is inert unless asked for (pytest and stdlib only at import)

    # lazy: the analysis stack loads only in a run that asked for pdtrace
    from pdtrace.analysis import summarize_findings
    from pdtrace.report.terminal import render_terminal  # lazy: the reporters load only in a run that asked for pdtrace

    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=False, soft_wrap=True)
    render_terminal(findings, summarize_findings(findings), console, trace=trace, start_ns=start_ns)
    return out.getvalue()

"""`pdtrace record -o TRACE [--force] [--flight SECONDS] -- CMD ARGS...`: run a command (a vLLM server, a benchmark)
with recording on.

`--flight SECONDS [--flight-mb MB] [--flight-dump-on-exit]`: flight mode (pdtrace.recording.flight). Every process
keeps its last SECONDS of events in memory and writes nothing until a dump: an engine error, the dump signal
(SIGUSR2), `pdtrace dump TRACE`, or (with --flight-dump-on-exit) its exit; each dump is a trace of its own,
`TRACE/dump-NNNN/`. The settings travel as PDTRACE_FLIGHT, PDTRACE_FLIGHT_MB, PDTRACE_FLIGHT_DUMP_ON_EXIT.
`--pair DIR` (PDTRACE_FLIGHT_PAIR): the P/D pair's folder, whose every flight recording an engine error on one
side dumps with it (`pdtrace.recording.flight.pair_of`; by default a KV-transfer engine pairs with the KV-transfer
recordings beside TRACE; `none`: no pair).

Recording is switched on for the command and every process it starts by `PDTRACE_TRACE_DIR` (read by pdtrace's
`vllm.general_plugins` entry point in each vLLM process). If the user restricts vLLM's plugins with `VLLM_PLUGINS`,
`pdtrace` is added to the list so the entry point still runs. The command gets SIGINT and SIGTERM forwarded; its
exit status becomes pdtrace's. `TRACE/_manifest.json` records the command, pdtrace's and vLLM's versions (vLLM's
read from the importable `vllm` module, whatever distribution installed it, without importing vLLM), start, end and
exit status.

`--dry-run` records vLLM's real EngineCore on a simulated cluster instead (pdtrace.dryrun), no command needed.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from pdtrace import __version__
from pdtrace.cli.app import app, err_console
from pdtrace.dryrun import DryRunConfig, run_dry_run
from pdtrace.errors import RecordingError, UsageError
from pdtrace.format import MANIFEST_NAME
from pdtrace.recording.session import TRACE_DIR_ENV

if TYPE_CHECKING:  # pragma: no cover
    from pdtrace.recording.flight import FlightConfig

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _vllm_version() -> str | None:
    """The importable vLLM's version, whatever distribution ships it (see `installed_vllm_version`)."""
    from pdtrace.recording.vllm import installed_vllm_version  # lazy: the hook tables load only for `record`

    return installed_vllm_version()


def _vllm_table(version: str | None) -> str | None:
    """The hook table pdtrace applies to vLLM `version` (`v0_33`), or None (not installed, or unsupported)."""
    from pdtrace.recording.vllm import table_for  # lazy: the hook tables load only for `record`

    entry = table_for(version) if version else None
    return entry.name if entry is not None else None


def _print_release(vllm_version: str | None, table: str | None) -> None:
    """The stderr line naming the vLLM release and the hook table a recording uses (also in the manifest)."""
    err_console.print(f"pdtrace: vLLM {vllm_version or '(not installed)'}, hook table "
                      f"{table or '(none: this release is not supported, nothing is recorded)'}",
                      markup=False, highlight=False)


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat()


def prepare_output(output: Path, force: bool) -> Path:
    """Create the trace directory; refuse one that holds anything unless `force`."""
    if output.exists() and not output.is_dir():
        raise RecordingError(f"{output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise RecordingError(f"{output} is not empty (use --force to record into it anyway)")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecordingError(f"cannot create {output}: {exc.strerror or exc}") from None
    return output.resolve()


def write_manifest(output: Path, manifest: dict[str, Any]) -> None:
    """Write `_manifest.json` atomically (a reader never sees half of it)."""
    tmp = output / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, output / MANIFEST_NAME)


def recording_env(output: Path, base: dict[str, str] | None = None,
                  flight: "FlightConfig | None" = None) -> dict[str, str]:
    """The command's environment: the recording switch on (in flight mode with `flight`), and pdtrace allowed if
    VLLM_PLUGINS filters plugins."""
    env = dict(os.environ if base is None else base)
    env[TRACE_DIR_ENV] = str(output)
    if flight is not None:
        env.update(flight.env())
    plugins = env.get("VLLM_PLUGINS")
    if plugins:  # unset or empty means "all plugins" to vLLM; a list must name pdtrace
        names = [p.strip() for p in plugins.split(",") if p.strip()]
        if "pdtrace" not in names:
            env["VLLM_PLUGINS"] = ",".join([*names, "pdtrace"])
    return env


def run_recorded(command: list[str], output: Path, flight: "FlightConfig | None" = None) -> int:
    """Run `command` with recording into `output` (in flight mode with `flight`: nothing is written until a dump);
    forward SIGINT/SIGTERM; write the manifest; return its status."""
    start_ns = time.time_ns()
    vllm_version = _vllm_version()
    manifest: dict[str, Any] = {
        "command": command,
        "pdtrace_version": __version__,
        "vllm_version": vllm_version,
        "vllm_table": _vllm_table(vllm_version),
        "created": _iso(start_ns),
        "start_ns": start_ns,
        "end": None,
        "end_ns": None,
        "exit_status": None,
        "trace_dir": str(output),
    }
    if flight is not None:
        manifest["flight"] = {"seconds": flight.seconds, "mb": flight.mb, "dump_on_exit": flight.dump_on_exit,
                              "signal": flight.signal_name}
        if flight.pair is not None:
            manifest["flight"]["pair"] = flight.pair
    write_manifest(output, manifest)
    from pdtrace.recording.recorder import FLUSH_ACK_DIR, request_flush  # lazy: only a recording run needs it

    child: list[subprocess.Popen] = []
    pending: list[int] = []

    flushed: list[bool] = []

    def forward(signum: int, _frame: Any) -> None:
        if not child:  # before the command exists: deliver it as soon as it does
            pending.append(signum)
            return
        if flight is None and not flushed:
            # The first stop: every recording process hands its buffer over first, since `vllm serve` SIGKILLs its
            # engine and workers as soon as it is stopped (what they buffered since their last hand-over, up to a
            # second, was lost). Bounded: a process that does not answer in time is stopped anyway.
            flushed.append(True)
            try:
                t0 = time.monotonic()
                asked, answered = request_flush(output, timeout=FLUSH_BEFORE_STOP_S)
                if asked:
                    err_console.print(f"pdtrace: {answered} of {asked} recording processes handed their events over "
                                      f"in {(time.monotonic() - t0) * 1e3:.0f} ms; stopping the command",
                                      markup=False, highlight=False)
            except Exception:
                pass
        try:
            child[0].send_signal(signum)
        except ProcessLookupError:
            pass

    def dump_run(_signum: int, _frame: Any) -> None:
        # The dump signal sent to `pdtrace record` itself (whose pid the user sees): a dump of the whole run, as
        # `pdtrace dump OUTPUT` asks for (its default action would kill this wrapper and orphan the command).
        from pdtrace.recording.flight import live_processes, request_dump

        try:
            targets = live_processes(output)
            if targets:
                request_dump(output, "signal", targets)
        except OSError as exc:
            err_console.print(f"pdtrace: warning: could not ask for a dump: {exc}", markup=False)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():  # handlers first: no window without forwarding
        for sig in _FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, forward)
        if flight is not None:
            previous[flight.signum] = signal.signal(flight.signum, dump_run)
    try:
        try:
            child.append(subprocess.Popen(command, env=recording_env(output, flight=flight)))
        except OSError as exc:
            (output / MANIFEST_NAME).unlink(missing_ok=True)
            raise RecordingError(f"cannot run {command[0]!r}: {exc.strerror or exc}") from None
        _print_release(vllm_version, manifest["vllm_table"])
        for signum in pending:
            forward(signum, None)
        while True:
            try:
                returncode = child[0].wait()
                break
            except KeyboardInterrupt:  # a SIGINT delivered while no handler of ours was installed
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = returncode if returncode >= 0 else 128 - returncode  # killed by signal N: 128 + N, as shells do
    _wait_for_writer_processes(output)
    shutil.rmtree(output / FLUSH_ACK_DIR, ignore_errors=True)
    end_ns = time.time_ns()
    manifest.update(end=_iso(end_ns), end_ns=end_ns, exit_status=status,
                    signal=-returncode if returncode < 0 else None)
    write_manifest(output, manifest)
    return status


def _announce_flight(output: Path) -> None:
    dumps = sorted(p.name for p in output.glob("dump-*") if p.is_dir())
    if dumps:
        err_console.print(f"pdtrace: flight recorder dumps in {output}: {', '.join(dumps)}", markup=False,
                          highlight=False)
        err_console.print(f"pdtrace: analyze one with: pdtrace analyze {output / dumps[-1]}", markup=False,
                          highlight=False)
    else:
        err_console.print(f"pdtrace: flight recorder: no dump was asked for, nothing written to {output}",
                          markup=False, highlight=False)


#: How long a stop forwarded to the command waits, at most, for the recording processes to hand their buffers over
#: (each takes milliseconds: a marshal and a pipe write).
FLUSH_BEFORE_STOP_S = 2.0
#: How long `record` waits, after its command ended, for writer processes still writing what they received.
WRITERS_WAIT_S = 60.0


def _wait_for_writer_processes(output: Path, timeout: float = WRITERS_WAIT_S) -> None:
    """Wait until no writer process holds its shared lock on the trace's lock file (each holds it for its
    lifetime; see pdtrace.recording.writer_process.LOCK_ENV): they outlive the vLLM processes that vLLM killed,
    by the time it takes to write what those processes handed over. Then remove the lock file."""
    from pdtrace.recording.writer_process import LOCK_NAME  # lazy: only a recording run needs it

    path = output / LOCK_NAME
    if not path.exists():
        return
    try:
        import fcntl  # POSIX only: where it is missing, no writer could hold the lock
    except ImportError:  # no flock: nothing could have taken it
        return
    fd = os.open(path, os.O_RDWR)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    err_console.print(f"pdtrace: a writer process is still writing after {timeout:.0f} s; its last "
                                      "part files may appear later", markup=False, highlight=False)
                    return
                time.sleep(0.05)
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _announce(output: Path) -> None:
    err_console.print(f"pdtrace: trace written to {output}", markup=False, highlight=False)
    err_console.print(f"pdtrace: analyze it with: pdtrace analyze {output}", markup=False, highlight=False)


def _record_dry_run(output: Path, force: bool, options: dict[str, Any]) -> int:
    """The `--dry-run` branch: vLLM's real EngineCore on a simulated executor (pdtrace.dryrun).

    The configuration is checked before the output directory is made. Exits 0 even when vLLM raised inside the
    run (its assert, say): that is the trace's finding, recorded as an `engine_error` event, not a failure of the
    recording."""

    given = {name: value for name, value in options.items() if value is not None}
    if given.get("perturbations"):
        given["perturbations"] = [_json_object(text, "--perturb", "kind") for text in given["perturbations"]]
    if given.get("given_requests"):
        given["given_requests"] = [_json_object(text, "--given-request", "prompt_len")
                                   for text in given["given_requests"]]
    config = DryRunConfig(**given).validate()
    output = prepare_output(output, force)
    result = run_dry_run(config, output)
    manifest = json.loads((output / MANIFEST_NAME).read_text())
    _print_release(manifest.get("vllm_version"), manifest.get("vllm_table"))
    if result.error:
        err_console.print(f"pdtrace: vLLM raised during the dry run (recorded as engine_error): {result.error}",
                          markup=False)
    return 0


def _json_object(text: str, option: str, key: str) -> dict[str, Any]:
    """One value of a repeatable JSON option: an object holding `key` (UsageError otherwise)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or key not in value:
        raise UsageError(f"{option} takes a JSON object with a {key!r} (see pdtrace record --help); got {text!r}")
    return value


def _flight_config(seconds: float | None, mb: float | None, dump_on_exit: bool, pair: str | None = None,
                   output: Path | None = None) -> "FlightConfig | None":
    """The flight settings of --flight/--flight-mb/--flight-dump-on-exit/--pair (None: full recording); UsageError
    on bad values. The dump signal comes from PDTRACE_FLIGHT_SIGNAL if the user set it."""
    # lazy: the flight recorder's module loads only when flight mode is asked for
    from pdtrace.recording.flight import DEFAULT_MB, ENV_SIGNAL, PAIR_OFF, SIGNAL_DEFAULT, FlightConfig

    if seconds is None:
        if mb is not None or dump_on_exit or pair is not None:
            raise UsageError("--flight-mb, --flight-dump-on-exit and --pair need --flight SECONDS")
        return None
    if pair is not None and pair != PAIR_OFF:
        folder = Path(pair).resolve()
        if output is None or folder not in output.resolve().parents:
            raise UsageError(f"--pair {pair} must be a folder holding the output {output} (the pair's folder: "
                             f"-o RUN/prefill --pair RUN), or '{PAIR_OFF}'")
        pair = str(folder)
    config = FlightConfig(seconds=seconds, mb=DEFAULT_MB if mb is None else mb, dump_on_exit=dump_on_exit,
                          signal_name=os.environ.get(ENV_SIGNAL, "").strip().upper() or SIGNAL_DEFAULT, pair=pair)
    try:
        return config.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


_DRY_PREFIX = "dry_"


def _dry_run_parameters() -> list[inspect.Parameter]:
    """One option of `record` per DryRunConfig field (name with dashes, `--fault` repeatable, booleans as
    `--x/--no-x`), so the dry run's options and its configuration cannot drift apart. Defaults are None: only what
    the user gives is passed on, DryRunConfig keeps its own defaults."""
    from pdtrace.dryrun.config import FIELD_HELP, DryRunConfig  # no vLLM import

    params = []
    for field in dataclasses.fields(DryRunConfig):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        help_text = FIELD_HELP.get(field.name, "")
        if field.name == "faults":
            names, annotation = ["--fault"], Optional[list[str]]
        elif field.name == "perturbations":
            names, annotation = ["--perturb"], Optional[list[str]]
        elif field.name == "given_requests":
            names, annotation = ["--given-request"], Optional[list[str]]
        elif isinstance(default, bool):
            flag = "prefix-caching" if field.name == "enable_prefix_caching" else field.name.replace("_", "-")
            names, annotation = [f"--{flag}/--no-{flag}"], Optional[bool]
            help_text = f"{help_text} [default: {'on' if default else 'off'}]"
        else:
            names, annotation = [f"--{field.name.replace('_', '-')}"], Optional[type(default)]
            help_text = f"{help_text} [default: {default}]"
        option = typer.Option(None, *names, help=help_text, show_default=False, rich_help_panel="Dry run")
        params.append(inspect.Parameter(_DRY_PREFIX + field.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
    return params


def record(
    output: Path = typer.Option(..., "-o", "--output", help="Trace directory to create (must be empty)."),
    force: bool = typer.Option(False, "--force", help="Record into a non-empty output directory."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Record vLLM's real EngineCore on a simulated cluster; no command."),
    flight_seconds: Optional[float] = typer.Option(
        None, "--flight", metavar="SECONDS", rich_help_panel="Flight recorder",
        help="Flight mode: every process keeps its last SECONDS of events in memory and writes them only when "
             "dumped (engine error, the dump signal SIGUSR2, `pdtrace dump OUTPUT`)."),
    flight_mb: Optional[float] = typer.Option(None, "--flight-mb", metavar="MB", rich_help_panel="Flight recorder",
                                              help="Memory bound of each process's window [default: 256]."),
    flight_dump_on_exit: bool = typer.Option(False, "--flight-dump-on-exit", rich_help_panel="Flight recorder",
                                             help="Also dump each process's window when it exits."),
    pair: Optional[str] = typer.Option(
        None, "--pair", metavar="DIR", rich_help_panel="Flight recorder",
        help="The P/D pair's folder holding OUTPUT and the other side's recording: an engine error on either side "
             "dumps both into DIR/dump-NNNN/. Without it, a KV-transfer engine (--kv-transfer-config) pairs with "
             "the KV-transfer recordings beside OUTPUT; 'none': this side only."),
    command: list[str] = typer.Argument(None, metavar="-- CMD [ARGS]...",
                                        help="The command to run with recording on (after `--`)."),
    **dry_options: Any,
) -> None:
    """Run CMD with pdtrace recording every vLLM process it starts, into the trace directory OUTPUT; or, with
    --dry-run, drive vLLM's real engine core on a simulated cluster (options under "Dry run")."""
    command = list(command or [])
    options = {name[len(_DRY_PREFIX):]: value for name, value in dry_options.items()}
    if dry_run:
        if command:
            raise UsageError("--dry-run takes no command")
        if flight_seconds is not None or flight_mb is not None or flight_dump_on_exit or pair is not None:
            raise UsageError("--flight records a command, not a dry run")
        status = _record_dry_run(output, force, options)
        out = output.resolve()
    else:
        given = sorted(name for name, value in options.items() if value not in (None, []))
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} is a dry-run option: add --dry-run")
        if not command:
            raise UsageError("no command to record: pdtrace record -o TRACE -- CMD [ARGS]...")
        flight = _flight_config(flight_seconds, flight_mb, flight_dump_on_exit, pair, output)
        out = prepare_output(output, force)
        status = run_recorded(command, out, flight)
        if flight is not None:
            _announce_flight(out)
            raise typer.Exit(status)
    _announce(out)
    raise typer.Exit(status)


_base = inspect.signature(record)
record.__signature__ = _base.replace(parameters=[  # type: ignore[attr-defined]
    p for p in _base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD] + _dry_run_parameters())
app.command("record", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            no_args_is_help=True)(record)

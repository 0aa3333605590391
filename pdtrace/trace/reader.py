"""Open a trace: a directory of Parquet part files (or one file) -> `Trace`, checked against the format.

How it reads, and why it is about as fast as pyarrow reading the columns:

1. List the part files: `**/*.parquet` under the directory, in path order, pruning every file or folder whose name
   starts with `_` or `.` (the manifest, a recorder's temporary files). Read `_manifest.json` if present (bad JSON
   is a warning, not fatal).
2. Read each file's footer only (schema, row count, key-value metadata, row-group statistics) and check it
   (`validate.check_metadata`, `validate.check_schema`). A file whose footer cannot be read (not Parquet,
   truncated, empty) is skipped with a warning and recorded in `Trace.skipped`; when every file is unreadable,
   that is an error. A readable file with a wrong schema or an unknown schema version is an error, not a skip:
   the trace is not something this pdtrace understands, and quietly dropping its events would mislead.
   Files whose `instance` statistics rule out the requested instances are not opened again.
3. Read the remaining files through `pyarrow.dataset` (one dataset per run of files with the same schema, so
   files keep their order), projecting the requested columns and pushing the instance and time filters down
   (row groups outside the time window are skipped by their statistics). A file whose data turns out to be
   corrupt is then read alone, skipped, and reported like an unreadable footer.
4. Normalise to exactly `pdtrace.format.SCHEMA` (the requested columns, in format order): dictionary columns
   dictionary<int32, string> with one dictionary per column across files, `req`/`detail` plain strings, integer
   columns cast (safely) to the format's widths, `blocks` list<int32>. Analyses rely on this.
5. With `validate=True`, check the values of the loaded table in one vectorised pass (`validate.check_values`);
   only when that finds something are the files re-checked one by one, so that the error names the file and the
   row within it. That pass includes `seq` order: strictly increasing within each part file (seq may restart
   from one file to the next, see `pdtrace.trace.validate`), and a file that goes backwards is an error, since the
   analyses would replay it in the wrong order. Where each file's rows start in the loaded table is known from
   the footers' row counts when nothing was filtered; with an instance or time filter it is not, so the pass
   looks for seq going backwards between rows of one writer anywhere, and only if it finds that (two files of one
   writer whose seq restarts, or a real violation) are the files re-checked one by one to tell which.

The whole load allocates from Arrow's system (malloc) memory pool rather than the default mimalloc one: mimalloc
backs its arenas with transparent huge pages here, and zeroing fresh 2 MiB pages made the reading and casting cost
1-3 s of system time at 10M events, varying with the machine's load, against ~0.3 s from malloc (the default pool
is restored afterwards; buffers remember the pool they came from).

Bad input raises `pdtrace.errors.TraceError` with one line naming the file and the problem. Warnings (skipped
files, unknown kinds, a bad manifest) are kept in `Trace.warnings`, and also issued as Python warnings of category
`TraceWarning` unless `warn=False` (the CLI passes False and prints `Trace.warnings` on stderr itself).
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pdtrace.errors import TraceError, UsageError
from pdtrace.format import COLUMNS, DUMP_PREFIX, MANIFEST_NAME, SCHEMA, flight_recordings
from pdtrace.trace.model import WINDOW_KEEPS, SkippedFile, Trace, TraceFile, later_window
from pdtrace.trace.names import readable_names, table_facts
from pdtrace.trace.validate import (TraceWarning, describe_parquet_bytes, check_metadata, check_schema, check_values,
                                    first_seq_violation)



def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether a trace location is a URL (`s3://bucket/trace`, `file:///data/trace`) rather than a local path."""
    return "://" in str(path)


def location(path: str | os.PathLike[str]) -> tuple[pafs.FileSystem | None, str]:
    """(filesystem, path within it) of a trace location: (None, path) for a local path; for a URL, pyarrow's
    filesystem for its scheme (`FileSystem.from_uri`: file, s3, gs, hdfs, ...), else fsspec's when installed (any
    protocol it knows). A URL nothing can open is a TraceError."""
    text = str(path)
    if not is_url(text):
        return None, text
    try:
        return pafs.FileSystem.from_uri(text)
    except (pa.ArrowException, ValueError, OSError) as exc:
        why = " ".join(str(exc).split())[:160]
    try:
        import fsspec  # optional dependency: only URLs pyarrow cannot open need fsspec

        protocol, inner = text.split("://", 1)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(protocol))), inner
    except ImportError:
        raise TraceError(f"{text}: cannot open this URL ({why}; fsspec is not installed)") from None
    except (ValueError, OSError) as exc:
        raise TraceError(f"{text}: cannot open this URL ({' '.join(str(exc).split())[:160]})") from None


def _url_of(root: str, inner: str) -> str:
    """The URL of a file found under the URL `root` (its scheme, then its path within the filesystem)."""
    return root.split("://", 1)[0] + "://" + inner


def _open_parquet(name: str) -> pq.ParquetFile:
    fs, inner = location(name)
    return pq.ParquetFile(fs.open_input_file(inner)) if fs is not None else pq.ParquetFile(name)


def read_columns(name: str, columns: list[str]) -> pa.Table:
    """Some columns of one part file (a local path or a URL), as stored."""
    fs, inner = location(name)
    return pq.read_table(inner, columns=columns, filesystem=fs)


def dataset(paths: list[str], format: Any = "parquet") -> ds.Dataset:
    """A pyarrow dataset over part files (local paths, or URLs of one filesystem), in the given order."""
    fs, _ = location(paths[0]) if paths else (None, "")
    return ds.dataset([location(p)[1] for p in paths] if fs is not None else paths, format=format, filesystem=fs)


def _find_remote_part_files(fs: pafs.FileSystem, root: str, inner: str) -> list[str]:
    """find_part_files for a directory on a (remote) filesystem: URLs of its `*.parquet`, pruned the same way."""
    base = inner.rstrip("/")
    found = []
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        if info.type != pafs.FileType.File or not info.path.endswith(".parquet"):
            continue
        parts = info.path[len(base):].strip("/").split("/")
        if any(part.startswith(("_", ".")) for part in parts):
            continue
        found.append(_url_of(root, info.path))
    return sorted(found)


def _refuse_flight_root(root: Path) -> None:
    """A flight recording's directory (it holds the `_flight/` registry), or a folder holding several (a P/D pair's
    `prefill/` and `decode/`), is not one trace: each of their dumps is (`dump-NNNN/`, windows that overlap), so
    reading them together would replay events twice. TraceError naming them."""
    recordings = flight_recordings(root)
    if not recordings:
        return

    def dumps_in(folder: Path) -> list[Path]:
        return sorted(p.relative_to(root) for p in folder.glob(DUMP_PREFIX + "*") if p.is_dir())

    if recordings == [root]:
        what, joint = "a flight recording", []
    else:  # and the dumps of them all (`pdtrace dump ROOT`), last: the example, one trace of the pair
        names = ", ".join(str(r.relative_to(root)) for r in recordings)
        what, joint = f"a folder of {len(recordings)} flight recordings ({names})", dumps_in(root)
    dumps = [d for r in recordings for d in dumps_in(r)] + joint
    if dumps:
        shown = ", ".join(map(str, dumps[-3:])) + (f" (and {len(dumps) - 3} more)" if len(dumps) > 3 else "")
        raise TraceError(f"{root} is {what}, not one trace: read one of its dumps ({shown}), e.g. "
                         f"{root / dumps[-1]}")
    raise TraceError(f"{root} is {what} with no dump yet (ask for one with: pdtrace dump {root})")


def find_part_files(directory: Path) -> list[Path]:
    """Every `*.parquet` under `directory`, sorted by path; names starting with `_` or `.` are pruned at any level
    (so a folder `_tmp/` hides everything below it)."""
    found: list[Path] = []
    for folder, subfolders, files in os.walk(directory):
        subfolders[:] = [d for d in subfolders if not d.startswith(("_", "."))]
        found.extend(Path(folder, f) for f in files if f.endswith(".parquet") and not f.startswith(("_", ".")))
    return sorted(found)


def describe_unreadable(path: str | Path, exc: BaseException) -> str:
    """Why a file could not be read as Parquet, in words (not Parquet, empty, truncated or corrupt)."""
    try:
        fs, inner = location(path)
        if fs is None:
            size = os.path.getsize(path)
            opened: Any = open(path, "rb")
        else:
            size = fs.get_file_info(inner).size or 0
            opened = fs.open_input_file(inner)
        with opened as handle:
            head = handle.read(4)
            handle.seek(max(size - 4, 0))
            tail = handle.read(4)
    except (OSError, pa.ArrowException) as os_exc:
        return f"cannot be read ({getattr(os_exc, 'strerror', None) or os_exc})"
    return describe_parquet_bytes(size, head, tail, exc)


def _read_manifest(directory: Path | str, notes: list[str], fs: pafs.FileSystem | None = None,
                   inner: str = "") -> dict[str, Any] | None:
    """`_manifest.json` of a trace directory (local; or `inner` on the filesystem `fs` of the URL `directory`),
    or None; bad JSON is a note, not an error."""
    if fs is None:
        local = Path(directory) / MANIFEST_NAME
        shown, exists = str(local), local.is_file()

        def read() -> str:
            return local.read_text(encoding="utf-8")
    else:
        name = inner.rstrip("/") + "/" + MANIFEST_NAME
        shown, exists = _url_of(str(directory), name), fs.get_file_info(name).type == pafs.FileType.File

        def read() -> str:
            with fs.open_input_stream(name) as handle:
                return handle.read().decode("utf-8")
    if not exists:
        return None
    try:
        manifest = json.loads(read())
    except (OSError, pa.ArrowException, UnicodeDecodeError, ValueError) as exc:
        notes.append(f"{shown}: not valid JSON, manifest ignored ({' '.join(str(exc).split())})")
        return None
    if not isinstance(manifest, dict):
        notes.append(f"{shown}: not a JSON object, manifest ignored")
        return None
    return manifest


def _resolve_columns(columns: Iterable[str] | None) -> list[str]:
    if columns is None:
        return list(COLUMNS)
    if isinstance(columns, str):
        columns = [columns]
    wanted = set(columns)
    unknown = sorted(wanted - set(COLUMNS))
    if unknown:
        raise UsageError(f"unknown trace column(s): {', '.join(unknown)} (the format's columns: "
                         f"{', '.join(COLUMNS)})")
    return [c for c in COLUMNS if c in wanted]


def _resolve_instances(instances: str | Iterable[str] | None) -> list[str] | None:
    if instances is None:
        return None
    if isinstance(instances, str):
        return [instances]
    return [str(i) for i in instances]


def column_stats(metadata: pq.FileMetaData, name: str) -> list[tuple[Any, Any]] | None:
    """(min, max) of a column in each row group of a file, from its footer; None when the file has no such column
    or a row group has no statistics for it (an all-null row group has none: its (None, None) is left out)."""
    try:
        index = metadata.schema.names.index(name)
    except ValueError:
        return None
    out = []
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(index).statistics
        if stats is not None and not stats.has_min_max and stats.null_count == metadata.row_group(group).num_rows:
            continue
        if stats is None or not stats.has_min_max:
            return None
        out.append((stats.min, stats.max))
    return out


def _instance_stats_exclude(metadata: pq.FileMetaData, wanted: set[str]) -> bool:
    """True when the row-group statistics of `instance` prove that no row of the file is a wanted instance."""
    try:
        index = metadata.schema.names.index("instance")
    except ValueError:
        return False
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(index).statistics
        if stats is None or not stats.has_min_max:
            return False
        low, high = stats.min, stats.max
        if isinstance(low, bytes) or isinstance(high, bytes):
            return False
        if any(low <= w <= high for w in wanted):
            return False
    return True


def _filter_expression(instances: list[str] | None, since_ns: int | None, until_ns: int | None,
                       keep_config: bool = False) -> ds.Expression | None:
    parts = []
    if instances is not None:
        parts.append(ds.field("instance").isin(instances))
    if since_ns is not None:
        since = ds.field("ts_ns") >= int(since_ns)
        parts.append(since | ds.field("kind").isin(list(WINDOW_KEEPS)) if keep_config else since)
    if until_ns is not None:
        parts.append(ds.field("ts_ns") < int(until_ns))
    expression = None
    for part in parts:
        expression = part if expression is None else expression & part
    return expression


def normalize_table(table: pa.Table, columns: list[str] | None = None, where: str = "<table>",
                    req_dictionary: bool = False) -> pa.Table:
    """Cast a table whose types `validate.check_schema` accepts to exactly the format's types, in format order,
    keeping only `columns` (all format columns by default). Dictionary columns share one dictionary per column.
    `req_dictionary`: a `req` read as REQ_DICTIONARY_TYPE stays so, its chunks' dictionaries as read (see
    `open_trace`)."""
    columns = list(COLUMNS) if columns is None else columns
    fields = [SCHEMA.field(name) for name in columns]
    arrays = []
    for i, target in enumerate(fields):
        column = table.column(target.name)
        if req_dictionary and target.name == "req":
            fields[i] = target = pa.field("req", REQ_DICTIONARY_TYPE, target.nullable)
        if column.type != target.type:
            try:
                if target.name == "req" and req_dictionary:  # another string type: one type for every run
                    column = (column.cast(REQ_DICTIONARY_TYPE) if pa.types.is_dictionary(column.type)
                              else pc.dictionary_encode(column.cast(pa.string())))
                elif pa.types.is_dictionary(target.type):
                    if pa.types.is_dictionary(column.type):
                        if column.type.value_type != pa.string():
                            column = column.cast(pa.dictionary(column.type.index_type, pa.string()))
                    elif column.type != pa.string():
                        column = column.cast(pa.string())
                elif pa.types.is_dictionary(column.type):
                    column = column.cast(column.type.value_type)
                column = column.cast(target.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise TraceError(f"{where}: column '{target.name}' cannot be read as {target.type}: "
                                 f"{' '.join(str(exc).split())[:160]}") from None
        arrays.append(column)
    return unified(pa.Table.from_arrays(arrays, schema=pa.schema(fields)))


def unified(table: pa.Table) -> pa.Table:
    """The table with one dictionary per dictionary column of the format's types (`Table.unify_dictionaries`), a
    `req` kept as REQ_DICTIONARY_TYPE left with its chunks' own: unifying a request dictionary per row group costs
    what decoding the strings does (a hash of each), and its readers take the chunks' codes (`pdtrace.analysis.
    columns`)."""
    if not any(pa.types.is_dictionary(f.type) for f in table.schema):
        return table
    if "req" not in table.column_names or table.schema.field("req").type != REQ_DICTIONARY_TYPE:
        return table.unify_dictionaries()
    at = table.column_names.index("req")
    return table.remove_column(at).unify_dictionaries().add_column(at, table.schema.field("req"),
                                                                   table.column("req"))


def _empty_table(columns: list[str], req_dictionary: bool = False) -> pa.Table:
    fields = [SCHEMA.field(c) for c in columns]
    if req_dictionary:  # the type a read of rows would give it
        fields = [pa.field("req", REQ_DICTIONARY_TYPE, f.nullable) if f.name == "req" else f for f in fields]
    return pa.schema(fields).empty_table()


# `req` is read as a dictionary (Parquet stores it dictionary-encoded): the table still gets plain strings (the
# format's type, cast in normalize_table), and the dictionary indices are kept for the analyses, which would
# otherwise hash every string again to get request codes.
_DICTIONARY_READ = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns={"req"}))

#: Attribute of a loaded `Trace` holding `(table, req column as dictionary<int32, string>)`; valid only while
#: `trace.table` is that same table object.
REQ_DICTIONARY_ATTR = "_req_dictionary"
#: The type `req` is read as (`_DICTIONARY_READ`), and kept as with `open_trace(req_dictionary=True)`
REQ_DICTIONARY_TYPE = pa.dictionary(pa.int32(), pa.string())


def _read_files(paths: list[str], columns: list[str], expression: ds.Expression | None,
                inside: tuple[int, int] | None = None, selective: bool = False) -> pa.Table:
    """The rows of `paths` that `expression` keeps. `selective`: it keeps few of them (a `rows` filter: one
    request's rows, one step's), so the scanner filters batch by batch and holds only those; otherwise `_sliced`
    keeps whole row groups as slices (a window: most rows)."""
    files = dataset(paths, format=_DICTIONARY_READ if "req" in columns else "parquet")
    if expression is None:
        return files.to_table(columns=columns)
    if selective or set(columns) != set(COLUMNS):  # the expression may name a column not read: the scanner filters
        return files.to_table(columns=columns, filter=expression)
    return _sliced(files, columns, expression, inside)


def _kept(table: pa.Table, expression: ds.Expression, inside: tuple[int, int] | None) -> np.ndarray:
    """Per row of `table`, whether `expression` keeps it (null: not). `inside` = (since, until): the expression
    keeps every row with since <= ts_ns < until (a time window's, no other filter), so it is evaluated only on the
    batches holding a row outside (the window's two ends): a 5M-row window of bench/long_trace.py, CPU 9-13 ms
    against 20-29 ms (one core); with `keep_config`, whose is_in decodes the dictionary `kind` column, 12-31 ms
    against 88-107 ms."""
    def evaluated(part: pa.Table) -> np.ndarray:
        keep = ds.dataset(part).to_table(columns={"keep": expression}).column("keep")
        return pc.fill_null(keep, False).to_numpy(zero_copy_only=False) if len(keep) else np.zeros(0, bool)

    if inside is None or "ts_ns" not in table.column_names:
        return evaluated(table)
    since, until = inside
    out = np.empty(table.num_rows, bool)
    start = 0
    for batch in table.to_batches():
        column = batch.column("ts_ns")
        piece = out[start:start + len(column)]
        start += len(column)
        if column.null_count:  # not a valid trace (the checks say so later): the expression decides
            piece[...] = evaluated(pa.Table.from_batches([batch]))
            continue
        ts = column.to_numpy()
        np.greater_equal(ts, since, out=piece)
        piece &= ts < until
        if not piece.all():
            piece |= evaluated(pa.Table.from_batches([batch]))
    return out


def _sliced(files: ds.Dataset, columns: list[str], expression: ds.Expression,
            inside: tuple[int, int] | None = None) -> pa.Table:
    """The rows of `files` that `expression` keeps, as the scanner's filter would give them (same rows, same order),
    without copying every kept row: row groups are pruned by their statistics as the scanner does, then a row
    group whose kept rows are all of it, or one run of at least half of it, is kept as a zero-copy slice; only the
    others are filtered (copied). A time window (`since_ns`/`until_ns`, the windows of
    `pdtrace.analysis.windows`) keeps whole row groups but at its two ends: 5M of 5.9M rows read, CPU 1.0-1.2 s
    against 1.4-2.3 s for the scanner's filter, which copies every column of every kept row (bench/long_trace.py,
    loaded machine)."""
    groups = [group for fragment in files.get_fragments()
              for group in fragment.split_by_row_group(filter=expression, schema=files.schema)]
    table = ds.FileSystemDataset(groups, files.schema, files.format, files.filesystem).to_table(columns=columns)
    keep = _kept(table, expression, inside)
    batches, start = [], 0
    for batch in table.to_batches():
        mask = keep[start:start + batch.num_rows]
        start += batch.num_rows
        kept = int(np.count_nonzero(mask))
        if kept == batch.num_rows:
            batches.append(batch)
        elif kept:
            rows = np.flatnonzero(mask)
            run = rows[-1] - rows[0] + 1 == kept
            batches.append(batch.slice(int(rows[0]), kept) if run and 2 * kept >= batch.num_rows
                           else batch.filter(pa.array(mask)))
    return pa.Table.from_batches(batches, schema=table.schema)


def _req_dictionary(table: pa.Table) -> pa.ChunkedArray | None:
    """The `req` column of a freshly read table when it came as dictionary<int32, string>, else None."""
    if "req" not in table.column_names:
        return None
    column = table.column("req")
    if column.type != REQ_DICTIONARY_TYPE:
        return None
    return column


@contextmanager
def system_memory_pool() -> Iterator[None]:
    """Arrow allocates from the system (malloc) pool meanwhile (see the module docstring); restored after. Also
    for other reads of many rows (`pdtrace.analysis.windows`)."""
    try:
        previous = pa.default_memory_pool()
        pa.set_memory_pool(pa.system_memory_pool())
    except (pa.ArrowException, AttributeError):  # a build without it: keep what there is
        yield
        return
    try:
        yield
    finally:
        pa.set_memory_pool(previous)


def open_trace(path: str | os.PathLike[str], columns: Iterable[str] | None = None,
               instances: str | Iterable[str] | None = None, since_ns: int | None = None,
               until_ns: int | None = None, validate: bool = True, warn: bool = True,
               only_files: Iterable[str] | None = None, keep_config: bool = False,
               rows: ds.Expression | None = None, req_dictionary: bool = False) -> Trace:
    """Load a trace directory (or one Parquet part file) as a `Trace` (see the module docstring).

    columns: format columns to load (default all); the table has them in format order.
    instances: keep only these instances (one name or several).
    since_ns, until_ns: keep only events with since_ns <= ts_ns < until_ns.
    validate: check the values of the loaded rows (null in a non-null column, unknown role or component, a kind
        on a component the format does not allow for it, a reason outside the kind's vocabulary, seq not strictly
        increasing within a writer's part file). Footers (column types, schema version) are always checked.
    warn: also issue the warnings (skipped files, unknown kinds, bad manifest) as Python `TraceWarning`s; they
        are always in `Trace.warnings`.
    only_files: read just these part files of the trace directory (one partition's, see
        `pdtrace.analysis.partitions`); the trace's path stays `path`. They are part of a trace whose other files
        are read elsewhere, so when every one of them turns out corrupt the result is an empty trace listing them
        in `skipped`, as a whole-trace read would skip them, not an error.
    rows: a further row filter (a pyarrow dataset expression), ANDed with the others, that keeps few rows (a
        window's extra rows, `pdtrace.analysis.windows`; a story's, `pdtrace.analysis.story`): the files are
        filtered batch by batch, so memory holds the kept rows, not the files'.
    keep_config: with since_ns, keep the `engine_config` rows from before it too (`model.WINDOW_KEEPS`: what the
        analysis of a window reads, configuration rather than history).
    req_dictionary: the table's `req` as read from Parquet, REQ_DICTIONARY_TYPE with a dictionary per row group,
        rather than the format's strings: for the analyses alone, which read requests by code (the windows of
        `pdtrace.analysis.windows`; bench/long_trace.py's 60M events on one core, `--profile`, 2 runs each: the
        windows' reads CPU 3.79-3.89 s against 4.16-4.17 s decoding the strings).
    """
    with system_memory_pool():
        return _open_trace(path, columns, instances, since_ns, until_ns, validate, warn, only_files, keep_config,
                           rows, req_dictionary)


@dataclass
class TraceFooters:
    """What the footers of a trace's part files say, without reading a row: steps 1-2 of the module docstring."""

    #: the trace's location: a local Path, or the URL as given
    root: Any
    manifest: dict[str, Any] | None
    #: readable files in path order, with their pdtrace metadata
    files: list[TraceFile]
    #: the footer of each readable file (row counts, row-group statistics), by path
    metadata: dict[str, pq.FileMetaData]
    #: the Arrow schema of each readable file (without its key-value metadata), by path
    schemas: dict[str, pa.Schema]
    skipped: list[SkippedFile]
    #: tolerated problems found so far (a bad manifest, notes on the files' metadata), one line each
    notes: list[str]


def read_footers(path: str | os.PathLike[str], only_files: Iterable[str] | None = None) -> TraceFooters:
    """List the part files of a trace (a directory, or one file) and read and check their footers (see the module
    docstring, steps 1-2). `only_files`: just these files of the trace (paths as listed), e.g. one partition's.
    Raises TraceError when nothing is readable, or a readable file has a wrong schema or schema version."""
    root = Path(path)
    notes: list[str] = []
    manifest = None
    fs, inner = location(path)
    if fs is not None:
        root_url = str(path)
        kind = fs.get_file_info(inner).type
        if kind == pafs.FileType.NotFound:
            raise TraceError(f"{root_url}: no such file or directory")
        if kind == pafs.FileType.Directory:
            candidates: list[Any] = (_find_remote_part_files(fs, root_url, inner) if only_files is None
                                     else list(only_files))
            manifest = _read_manifest(root_url, notes, fs, inner)
            if not candidates:
                raise TraceError(f"{root_url}: no Parquet files in this directory (a trace is a directory of "
                                 "*.parquet event files)")
        else:
            candidates = [root_url]
    elif not root.exists():
        raise TraceError(f"{root}: no such file or directory")
    elif root.is_dir():
        if only_files is None:
            _refuse_flight_root(root)
        candidates = find_part_files(root) if only_files is None else [Path(f) for f in only_files]
        manifest = _read_manifest(root, notes)
        if not candidates:
            raise TraceError(f"{root}: no Parquet files in this directory (a trace is a directory of *.parquet "
                             "event files)")
    elif root.is_file():
        candidates = [root]
    else:
        raise TraceError(f"{root}: not a file or directory")

    files: list[TraceFile] = []
    metadata_of: dict[str, pq.FileMetaData] = {}
    schemas: dict[str, pa.Schema] = {}
    skipped: list[SkippedFile] = []
    file_notes_seen: dict[str, list[str]] = {}  # a note's text without its file -> the files it applies to
    for candidate in candidates:
        name = str(candidate)
        try:
            with _open_parquet(name) as parquet:
                metadata = parquet.metadata
                schema = parquet.schema_arrow
        except (OSError, pa.ArrowException) as exc:
            skipped.append(SkippedFile(name, describe_unreadable(name, exc)))
            continue
        info, file_notes = check_metadata(metadata.metadata, name)
        file_notes += check_schema(schema, name)
        for note in file_notes:
            file_notes_seen.setdefault(note.removeprefix(f"{name}: "), []).append(name)
        files.append(TraceFile(path=name, rows=metadata.num_rows, **info))
        metadata_of[name] = metadata
        schemas[name] = schema.remove_metadata()

    # The same note on every part file (say, a column this pdtrace does not know) is said once.
    for text, names in file_notes_seen.items():
        more = f" (and {len(names) - 1} more files)" if len(names) > 1 else ""
        notes.append(f"{names[0]}: {text}{more}")

    if not files:
        if len(skipped) == 1:
            raise TraceError(f"{skipped[0].path}: {skipped[0].reason}")
        raise TraceError(f"{root}: none of the {len(skipped)} Parquet files could be read (first: "
                         f"{skipped[0].path}: {skipped[0].reason})")
    return TraceFooters(str(path) if fs is not None else root, manifest, files, metadata_of, schemas, skipped,
                        notes)


def _open_trace(path: str | os.PathLike[str], columns: Iterable[str] | None, instances: str | Iterable[str] | None,
                since_ns: int | None, until_ns: int | None, validate: bool, warn: bool,
                only_files: Iterable[str] | None = None, keep_config: bool = False,
                rows: ds.Expression | None = None, req_dictionary: bool = False) -> Trace:
    root: Any = str(path) if is_url(path) else Path(path)
    selected = _resolve_columns(columns)
    wanted_instances = _resolve_instances(instances)
    footers = read_footers(path, only_files)
    manifest, files, skipped, notes = footers.manifest, list(footers.files), list(footers.skipped), footers.notes
    runs: list[tuple[pa.Schema, list[str]]] = []  # consecutive files with one schema: one dataset each
    for file in files:
        name = file.path
        if wanted_instances is not None and _instance_stats_exclude(footers.metadata[name], set(wanted_instances)):
            continue
        plain = footers.schemas[name]
        if runs and runs[-1][0].equals(plain):
            runs[-1][1].append(name)
        else:
            runs.append((plain, [name]))

    expression = _filter_expression(wanted_instances, since_ns, until_ns, keep_config)
    # a time window alone keeps every row of [since, until) (`_kept`)
    inside = (int(since_ns), int(until_ns)) if (wanted_instances is None and rows is None and since_ns is not None
                                                 and until_ns is not None) else None
    selective = rows is not None
    if rows is not None:
        expression = rows if expression is None else expression & rows
    tables = []
    req_parts: list[pa.ChunkedArray | None] = []
    footer_rows = {f.path: f.rows for f in files}
    # Rows each loaded file contributed, in load order (for the seq check's file boundaries); None once unknown.
    file_rows: list[int] | None = []
    for _schema, paths in runs:
        try:
            raw = _read_files(paths, selected, expression, inside, selective)
            tables.append(normalize_table(raw, selected, paths[0], req_dictionary))
            req_parts.append(_req_dictionary(raw))
            counts = [footer_rows[name] for name in paths]
            if file_rows is not None and expression is None and sum(counts) == raw.num_rows:
                file_rows.extend(counts)
            else:
                file_rows = None
            del raw
        except TraceError:
            # A value that does not fit the format's type (say a pid beyond int32): name the file that holds it.
            for name in paths:
                normalize_table(_read_files([name], selected, expression, None, selective), selected, name)
            raise
        except (OSError, pa.ArrowException):
            # A corrupt data page somewhere in the run: read its files one by one and skip the bad ones.
            for name in paths:
                try:
                    tables.append(normalize_table(_read_files([name], selected, expression, None, selective),
                                                  selected, name, req_dictionary))
                    req_parts.append(None)
                    if file_rows is not None:
                        file_rows.append(tables[-1].num_rows)
                except (OSError, pa.ArrowException) as exc:
                    skipped.append(SkippedFile(name, describe_unreadable(name, exc)))
                    files = [f for f in files if f.path != name]
    if not files and only_files is None:
        raise TraceError(f"{root}: none of the {len(skipped)} Parquet files could be read (first: "
                         f"{skipped[0].path}: {skipped[0].reason})")
    table = unified(pa.concat_tables(tables)) if tables else _empty_table(selected, req_dictionary)

    if validate:
        file_starts = None
        if file_rows is not None and sum(file_rows) == table.num_rows:
            file_starts = list(itertools.accumulate(file_rows[:-1]))
        try:
            notes.extend(check_values(table, str(root), file_starts=file_starts, check_seq=file_starts is not None))
        except TraceError:
            _raise_first_file_violation(files, selected)
            raise
        if file_starts is None and first_seq_violation(table, str(root)) is not None:
            # Boundaries unknown (a filtered load): seq goes backwards within one writer somewhere, which is either
            # a restart from one of its files to the next (allowed) or a violation inside a file; the files decide.
            _raise_first_file_violation(files, selected)

    notes.extend(f"{s.path}: skipped: {s.reason}" for s in skipped)
    if warn:
        for note in notes:
            warnings.warn(note, TraceWarning, stacklevel=3)
    trace = Trace(table=table, path=str(root), manifest=manifest, files=files, skipped=skipped, warnings=notes)
    trace.window_start_ns, trace.window_source = trace_window(manifest, files, footers, since_ns)
    if only_files is None:  # the whole trace's footers: names as every other read of this trace gives them
        trace.instance_names = footer_names(footers)
    if req_parts and all(part is not None for part in req_parts):
        req = pa.chunked_array([c for part in req_parts for c in part.chunks],  # type: ignore[union-attr]
                               pa.dictionary(pa.int32(), pa.string()))
        if len(req) == table.num_rows:
            setattr(trace, REQ_DICTIONARY_ATTR, (table, req))
    return trace


def footer_facts(footers: TraceFooters) -> dict[str, tuple[set[str], int | None]]:
    """instance -> (its `role` values, its first ts_ns) from the footers (`names.readable_names`' input): the
    row-group statistics of `instance`, `role` and `ts_ns`; a file whose statistics do not name one instance and
    one role (several instances in a file, a writer without statistics) has those three columns read."""
    facts: dict[str, tuple[set[str], int | None]] = {}

    def add(instance: str, roles: Iterable[str], first: int | None) -> None:
        have_roles, have_first = facts.setdefault(instance, (set(), None))
        have_roles.update(roles)
        if first is not None and (have_first is None or first < have_first):
            facts[instance] = (have_roles, int(first))

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    for file in footers.files:
        metadata = footers.metadata[file.path]
        if metadata.num_rows == 0:
            continue
        inst, role, ts = (column_stats(metadata, c) for c in ("instance", "role", "ts_ns"))
        one_inst = {text(v) for pair in inst or [] for v in pair}
        one_role = {text(v) for pair in role or [] for v in pair}
        if inst and role and ts and len(one_inst) == 1 and len(one_role) == 1:
            add(one_inst.pop(), one_role, min(low for low, _ in ts))
            continue
        try:
            add_from = table_facts(read_columns(file.path, ["instance", "role", "ts_ns"]))
        except (OSError, pa.ArrowException):
            continue  # unreadable rows: skipped by the load as well
        for instance, (roles, first) in add_from.items():
            add(instance, roles, first)
    return facts


def footer_names(footers: TraceFooters) -> dict[str, str]:
    """instance -> readable name for the trace these footers list (`pdtrace.trace.names`)."""
    return readable_names(footer_facts(footers))


def trace_window(manifest: dict[str, Any] | None, files: list[TraceFile], footers: TraceFooters,
                 since_ns: int | None) -> tuple[int | None, str | None]:
    """(start, source) of the window a loaded trace holds, or (None, None) for a whole run: the latest of the files'
    `pdtrace.window_start_ns` ("metadata": from then on every dumping writer is recorded), a flight dump's manifest
    `window_start_ns` ("manifest") and a `since_ns` cut that left out earlier rows by the files' `ts_ns` statistics
    ("since"). docs/trace-format.md, "Traces that start mid-run"."""
    start: int | None = None
    source: str | None = None
    for file in files:
        start, source = later_window(start, source, file.window_start_ns, "metadata")
    if isinstance(manifest, dict) and manifest.get("window_start_ns") is not None:
        try:
            start, source = later_window(start, source, int(manifest["window_start_ns"]), "manifest")
        except (TypeError, ValueError):
            pass
    if since_ns is not None:
        lows = [low for f in files for low, _ in (column_stats(footers.metadata[f.path], "ts_ns") or [])]
        if not lows or min(lows) < since_ns:
            start, source = later_window(start, source, int(since_ns), "since")
    return start, source


def _raise_first_file_violation(files: list[TraceFile], columns: list[str]) -> None:
    """Re-check the loaded files one by one and raise the first violation with its file and row in that file.
    Only runs after the whole-table check found something, so its cost does not matter."""
    for file in files:
        try:
            table = normalize_table(read_columns(file.path, columns), columns, file.path)
        except (OSError, pa.ArrowException):
            continue
        check_values(table, file.path)


__all__ = ["open_trace", "read_footers", "footer_names", "footer_facts", "TraceFooters", "column_stats", "location",
           "is_url", "dataset",
           "read_columns", "find_part_files", "normalize_table", "describe_unreadable", "TraceWarning"]

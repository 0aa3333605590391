"""The pdtrace trace format, version 1, as code (docs/trace-format.md is its prose).

This module is on the recording path, which loads into every vLLM process: it imports only the standard library
and pyarrow. Everything that reads or writes a trace takes its column names, types and kind vocabulary from here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

SCHEMA_VERSION = "1"
#: Schema versions this build of pdtrace can read.
READABLE_SCHEMA_VERSIONS = frozenset({"1"})

# Parquet key-value metadata keys written on every part file.
META_SCHEMA_VERSION = "pdtrace.schema_version"
META_VERSION = "pdtrace.version"
META_SOURCE = "pdtrace.source"
META_DROPPED = "pdtrace.dropped_events"
#: Optional: the file holds a window of its writer's events that starts here (ns since the epoch), not its whole
#: history (a flight-recorder dump). Readers then treat the trace as starting mid-run (pdtrace.analysis.history).
META_WINDOW_START = "pdtrace.window_start_ns"

MANIFEST_NAME = "_manifest.json"

#: A flight recording (`pdtrace record --flight`) is a folder holding this registry, and its dumps `dump-NNNN/`,
#: each a trace of its own (docs/trace-format.md, "Flight recorder dumps").
FLIGHT_REGISTRY = "_flight"
DUMP_PREFIX = "dump-"


def flight_recordings(root: str | os.PathLike[str]) -> list[Path]:
    """The flight recordings at or under the local folder `root` (a P/D pair's `prefill/` and `decode/`), sorted:
    folders holding a FLIGHT_REGISTRY. Not searched: what readers skip (names starting with `_` or `.`), dumps, and
    the folders inside a recording."""
    found: list[Path] = []
    for folder, subfolders, _ in os.walk(root):
        if FLIGHT_REGISTRY in subfolders:
            found.append(Path(folder))
            subfolders[:] = []
            continue
        subfolders[:] = [d for d in subfolders if not d.startswith(("_", ".", DUMP_PREFIX))]
    return sorted(found)

_DICT = pa.dictionary(pa.int32(), pa.string())

#: The columns of an event file, in order. Every column is required; nullability as in the format.
SCHEMA = pa.schema(
    [
        pa.field("ts_ns", pa.int64(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("instance", _DICT, nullable=False),
        pa.field("role", _DICT, nullable=False),
        pa.field("pid", pa.int32(), nullable=False),
        pa.field("component", _DICT, nullable=False),
        pa.field("dp_rank", pa.int16()),
        pa.field("pp_rank", pa.int16()),
        pa.field("tp_rank", pa.int16()),
        pa.field("kind", _DICT, nullable=False),
        pa.field("step", pa.int64()),
        pa.field("req", pa.string()),
        pa.field("blocks", pa.list_(pa.int32())),
        pa.field("n", pa.int64()),
        pa.field("reason", _DICT),
        pa.field("status", _DICT),
        pa.field("delay_free", pa.bool_()),
        pa.field("deferred", pa.bool_()),
        pa.field("detail", pa.string()),
    ]
)
COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)
#: Columns that must never hold a null.
NON_NULL_COLUMNS: tuple[str, ...] = tuple(f.name for f in SCHEMA if not f.nullable)
#: Columns stored dictionary-encoded (read back as pandas categoricals).
DICTIONARY_COLUMNS: tuple[str, ...] = tuple(f.name for f in SCHEMA if pa.types.is_dictionary(f.type))
#: Scalar columns: everything but the list column (`blocks`) and the JSON column (`detail`).
SCALAR_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMNS if c not in ("blocks", "detail"))

ROLES = frozenset({"prefill", "decode", "both", "none"})
COMPONENTS = frozenset({"scheduler", "engine", "worker", "connector"})

#: Every event kind of version 1, with the component(s) that emit it. `None` means any component.
KINDS: dict[str, frozenset[str] | None] = {
    # scheduler side
    "engine_config": frozenset({"scheduler"}),
    "req_add": frozenset({"scheduler"}),
    "sched": frozenset({"scheduler"}),
    "req_sched": frozenset({"scheduler"}),
    "req_preempt": frozenset({"scheduler"}),
    "req_wait_kv": frozenset({"scheduler"}),
    "req_finish": frozenset({"scheduler"}),
    "blocks_alloc": frozenset({"scheduler"}),
    "blocks_free": frozenset({"scheduler"}),
    "blocks_pool_free": frozenset({"scheduler"}),
    "kv_send_done": frozenset({"scheduler"}),
    "kv_recv_done": frozenset({"scheduler"}),
    "kv_recv_fail": frozenset({"scheduler"}),
    # a KV read's destination blocks, where the connector decided them (added in pdtrace 0.1)
    "kv_recv_dest": frozenset({"scheduler"}),
    # engine loop
    "step_submit": frozenset({"engine"}),
    "step_output": frozenset({"engine"}),
    "engine_error": frozenset({"engine"}),
    # workers
    "exec_begin": frozenset({"worker", "connector"}),
    "exec_end": frozenset({"worker", "connector"}),
    # a wait inside an RPC (reason: what it waited for); the RPC's busy time less these is the rank's work
    "exec_wait_begin": frozenset({"worker", "connector"}),
    "exec_wait_end": frozenset({"worker", "connector"}),
    "kv_send_rank": frozenset({"worker", "connector"}),
    "kv_recv_rank": frozenset({"worker", "connector"}),
    "batch_add": frozenset({"worker", "connector"}),
    "batch_remove": frozenset({"worker", "connector"}),
    # recorder
    "recorder_gap": None,
    "recorder_off": None,
    # optional, connector-specific
    "kv_expire": None,
    "kv_heartbeat": None,
    "remote_read": None,
}

#: What a rank waited for inside an RPC (`exec_wait_*` reason): the previous PP stage's tensors, or the next stage
#: taking this one's.
WAIT_REASONS = frozenset({"pp_recv", "pp_send"})

#: `reason` vocabulary per kind, where the format fixes one (other kinds leave `reason` free or null).
REASONS: dict[str, frozenset[str]] = {
    "req_finish": frozenset({"stop", "length", "abort", "error", "repetition"}),
    "blocks_free": frozenset({"finished", "aborted", "preempted", "sent", "received", "load_failed", "skipped"}),
    "batch_add": frozenset({"new", "resumed", "rescheduled"}),
    "batch_remove": frozenset({"finished", "unscheduled", "preempted"}),
    "exec_wait_begin": WAIT_REASONS,
    "exec_wait_end": WAIT_REASONS,
}

#: vLLM's RequestStatus names (0.10 and 0.33), plus `unknown` for ids the scheduler no longer knows.
STATUSES = frozenset(
    {
        "WAITING",
        "WAITING_FOR_FSM",
        "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",
        "WAITING_FOR_REMOTE_KVS",
        "WAITING_FOR_STREAMING_REQ",
        "RUNNING",
        "PREEMPTED",
        "FINISHED_STOPPED",
        "FINISHED_LENGTH_CAPPED",
        "FINISHED_ABORTED",
        "FINISHED_IGNORED",
        "FINISHED_ERROR",
        "FINISHED_REPETITION",
        "unknown",
    }
)
FINISHED_STATUSES = frozenset(s for s in STATUSES if s.startswith("FINISHED_"))

#: Rule ids of `pdtrace analyze` (stable).
RULE_IDS = (
    "premature_free",
    "use_after_free",
    "double_free",
    "leaked_blocks",
    "completion_before_finish",
    "unscheduled_request",
    "pipeline_bubble",
)
SEVERITIES = ("error", "warning", "info")


def file_metadata(version: str, source: str, dropped_events: int) -> dict[bytes, bytes]:
    """The Parquet key-value metadata every part file carries."""
    return {
        META_SCHEMA_VERSION.encode(): SCHEMA_VERSION.encode(),
        META_VERSION.encode(): version.encode(),
        META_SOURCE.encode(): source.encode(),
        META_DROPPED.encode(): str(int(dropped_events)).encode(),
    }

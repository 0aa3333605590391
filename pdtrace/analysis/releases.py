"""What the recorded vLLM release does, where the rules must know it: one row per release range.

The rules read the release a trace was recorded on, not a guess: each `engine_config` event carries it (detail
`vllm_version`, recorded since pdtrace's multi-release hooks), else the trace's manifest (`vllm_version`), else
its source (`vllm-0.33.0`). A trace that names no release (a hand-written one, a dry run of an old pdtrace) is
read as the newest supported release. docs/vllm-releases.md is this table for people; each row was read from
the release's own code (cited per field).

Algorithm: `behaviour_of(version)` finds the range holding the version (release tuples compared numerically);
`trace_behaviour(ctx)` takes the newest release named by the trace's engine_config events (a trace mixing
releases is judged by the newest, whose timeouts are the longest: no finding from the older one's shorter
timeout), falling back as above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdtrace.analysis.config import AnalysisConfig
from pdtrace.analysis.rulekit import engine_configs


@dataclass(frozen=True)
class ReleaseBehaviour:
    """How one range of vLLM releases (`first` <= release < `before`) behaves where the rules depend on it."""

    first: str
    before: str
    #: A free may be deferred to the step that last wrote the blocks (`defer_block_free`, 0.28+); before, every
    #: free is immediate.
    deferred_frees: bool
    #: A request aborted while WAITING_FOR_REMOTE_KVS: "delayed" (its blocks stay until the read ends, 0.16+:
    #: finish_requests' delay_free_blocks) or "immediate" (0.10 to 0.15: back to the pool while the read may still
    #: write them, a bug of those releases).
    abort_while_receiving: str
    #: The longest connector timeout after which a side frees blocks nobody read, seconds: NIXL's
    #: VLLM_NIXL_ABORT_REQUEST_TIMEOUT default (envs.py: 120 up to 0.11.0, 480 from 0.11.1 to 0.21.x); from 0.22
    #: NIXL's decode-side `decoder_kv_blocks_ttl` (480, nixl/scheduler.py:154-157) and Mooncake's
    #: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480). The default grace period of the leak and stuck-wait rules, except
    #: for a NIXL prefill side's send from 0.22 (`nixl_send_lease_s`).
    connector_timeout_s: float
    #: Whether an engine whose only requests are finished ones waiting for their KV send keeps stepping, to collect
    #: the completion and free the blocks (0.28+: `has_finished_requests` counts requests held for connector
    #: cleanup). Before (0.10 / 0.11: `has_requests` is waiting + running + `finished_req_ids`), the engine core
    #: sleeps on its input queue after one more step: the send completions and frees of its last requests wait for
    #: the next request, and a trace that ends there shows them still held.
    steps_for_pending_sends: bool
    #: What `_update_from_kv_xfer_finished` does with a send completion for an id the scheduler no longer knows.
    unknown_send: str
    #: ... and with a receive completion for such an id.
    unknown_recv: str
    #: From 0.22 (VLLM_NIXL_ABORT_REQUEST_TIMEOUT gone): NIXL's prefill side holds a finished request's blocks
    #: for the decode side's read under a lease, `kv_lease_duration` (30 s, nixl/scheduler.py:70-76, 640-655;
    #: 0.28+ pull_scheduler.py), which the decode side's heartbeats renew while its request waits for that read
    #: (worker.py `_handle_heartbeat`: to 2/3 of the lease from each heartbeat); the lease's expiry frees the
    #: blocks. None before (the abort timeout above). `send_grace_s` reads it.
    nixl_send_lease_s: float | None = None

    @property
    def releases(self) -> str:
        """The range for people (`0.10.1.1 to 0.11.0`)."""
        return f"{self.first} to {_before_label(self.before)}"


def _before_label(before: str) -> str:
    parts = before.split(".")
    if len(parts) == 2:
        return f"{parts[0]}.{int(parts[1]) - 1}.x"
    return {"0.11.0": "0.10.x", "0.11.1": "0.11.0"}.get(before, f"before {before}")


_ASSERTS = "vLLM asserts req_id in self.requests (_update_from_kv_xfer_finished) and the engine dies"
_STALE = "vLLM keeps the id in finished_recving_kv_req_ids unchecked (a stale entry)"

#: Oldest first. The rows' sources: each release's vllm/v1/core/sched/scheduler.py (finish_requests,
#: _update_from_kv_xfer_finished, _free_request_blocks, has_finished_requests), vllm/v1/core/sched/interface.py
#: (has_requests) and vllm/envs.py.
BEHAVIOURS: tuple[ReleaseBehaviour, ...] = (
    ReleaseBehaviour(
        "0.10.1.1", "0.11.0", deferred_frees=False, abort_while_receiving="immediate", connector_timeout_s=120.0,
        steps_for_pending_sends=False,
        unknown_send="vLLM raises KeyError (self.requests[req_id] in _update_from_kv_xfer_finished) and the engine "
                     "dies",
        unknown_recv=_STALE),
    ReleaseBehaviour(
        "0.11.0", "0.11.1", deferred_frees=False, abort_while_receiving="immediate", connector_timeout_s=120.0,
        steps_for_pending_sends=False,
        unknown_send="vLLM logs a warning and ignores it (_update_from_kv_xfer_finished)",
        unknown_recv=_STALE),
    ReleaseBehaviour(
        "0.11.1", "0.16", deferred_frees=False, abort_while_receiving="immediate", connector_timeout_s=480.0,
        steps_for_pending_sends=False,
        unknown_send=_ASSERTS,
        unknown_recv=_STALE),
    # 0.16.0:1705-1714 (finish_requests delays the free), 1986 (the receive completion's assert); NIXL's 480 s
    # (envs.py:1324); has_finished_requests counts finished_req_ids only (0.17.1:1785).
    ReleaseBehaviour(
        "0.16.0", "0.18", deferred_frees=False, abort_while_receiving="delayed", connector_timeout_s=480.0,
        steps_for_pending_sends=False,
        unknown_send=_ASSERTS, unknown_recv=_ASSERTS),
    # 0.18-0.27 (scheduler.py, core.py, nixl/scheduler.py of 0.18.0, 0.21.0, 0.22.0, 0.23.0, 0.24.0, 0.26.0,
    # 0.27.1): the abort delay of 0.16 (finish_requests, 0.18.0:1779), an assert on either unknown completion
    # (0.18.0:2100, 2109); an engine with only pending sends sleeps up to 0.21 (0.21.0:1792: has_finished_requests
    # counts finished_req_ids only) and keeps stepping from 0.22 (0.22.0:1884-1894); deferred frees from 0.24
    # (0.24.0:130-152); NIXL's prefill-side lease from 0.22.
    ReleaseBehaviour(
        "0.18.0", "0.22", deferred_frees=False, abort_while_receiving="delayed", connector_timeout_s=480.0,
        steps_for_pending_sends=False, unknown_send=_ASSERTS, unknown_recv=_ASSERTS),
    ReleaseBehaviour(
        "0.22.0", "0.24", deferred_frees=False, abort_while_receiving="delayed", connector_timeout_s=480.0,
        steps_for_pending_sends=True, unknown_send=_ASSERTS, unknown_recv=_ASSERTS, nixl_send_lease_s=30.0),
    ReleaseBehaviour(
        "0.24.0", "0.28", deferred_frees=True, abort_while_receiving="delayed", connector_timeout_s=480.0,
        steps_for_pending_sends=True, unknown_send=_ASSERTS, unknown_recv=_ASSERTS, nixl_send_lease_s=30.0),
    ReleaseBehaviour(
        "0.28.0", "0.34", deferred_frees=True, abort_while_receiving="delayed", connector_timeout_s=480.0,
        steps_for_pending_sends=True,
        unknown_send=_ASSERTS, unknown_recv=_ASSERTS, nixl_send_lease_s=30.0),
)
NEWEST = BEHAVIOURS[-1]


def release_key(version: str) -> tuple[int, ...]:
    """`0.10.1.1` -> (0, 10, 1, 1); a pre-release or local part is ignored (`0.33.1rc1+cpu` -> (0, 33, 1))."""
    head = re.split(r"[^\d.]", version.strip(), maxsplit=1)[0]
    return tuple(int(part) for part in head.split(".") if part)


def behaviour_of(version: str | None) -> ReleaseBehaviour:
    """The behaviour of vLLM release `version`; the newest supported one for None or a release outside every row
    (a trace of an unsupported release has no hook events to judge anyway)."""
    if version:
        key = release_key(version)
        for row in BEHAVIOURS:
            if release_key(row.first) <= key < release_key(row.before):
                return row
    return NEWEST


def trace_release(ctx: Any) -> str | None:
    """The vLLM release a trace was recorded on: the newest its engine_config events name, else the manifest's,
    else a `vllm-X` source; None when the trace does not say."""
    named = {str(cfg["vllm_version"]) for cfg in engine_configs(ctx).values() if cfg.get("vllm_version")}
    if named:
        return max(named, key=release_key)
    manifest = ctx.trace.manifest or {}
    if manifest.get("vllm_version"):
        return str(manifest["vllm_version"])
    sources = [str(s)[5:] for s in ctx.trace.sources or () if str(s).startswith("vllm-")]
    return max(sources, key=release_key) if sources else None


def trace_behaviour(ctx: Any) -> ReleaseBehaviour:
    """The behaviour of the release the trace was recorded on (cached per analysis)."""
    return ctx.cached("releases.trace_behaviour", lambda: behaviour_of(trace_release(ctx)))


def grace_configured(ctx: Any) -> bool:
    """Whether the analysis was given its own `grace_s` (`--grace-s`, `[tool.pdtrace]`): it then overrides every
    release's timeout, lease included."""
    return float(ctx.config.grace_s) != AnalysisConfig.grace_s


def grace_s(ctx: Any) -> float:
    """The grace period of the leak and stuck-wait rules: the configured `grace_s` where it was changed from its
    default, else the recorded release's longest connector timeout (120 s up to 0.11.0, 480 s later)."""
    if grace_configured(ctx):
        return float(ctx.config.grace_s)
    return trace_behaviour(ctx).connector_timeout_s


def nixl_send_lease_s(ctx: Any, connector: str | None) -> float | None:
    """The lease under which a NIXL prefill side holds a finished request's blocks for the decode side's read, for
    the recorded release (30 s from 0.22; None before, and for another connector or a configured `grace_s`).
    `connector` is the scheduler's engine_config `connector` (`NixlConnector`); a MultiConnector names no single
    connector and keeps the longest timeout."""
    if grace_configured(ctx) or not connector or "nixl" not in str(connector).lower():
        return None
    return trace_behaviour(ctx).nixl_send_lease_s

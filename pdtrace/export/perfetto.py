"""Perfetto protobuf trace from an export model, with the optional `perfetto` package's TraceProtoBuilder (pure
Python protobuf classes, fully offline; its trace-processor binary is never used or downloaded).

Tracks: a process track per instance, a thread track per scheduler / rank / request (as in the Chrome export), and a
counter track per (scheduler, owner state). Slices become TYPE_SLICE_BEGIN / TYPE_SLICE_END pairs; a transfer's
`kv send` mark carries a flow id that its `kv recv` mark terminates. Begin and end events are ordered with one
vectorised sort (ends before begins at one instant, the inner slice's end first, the outer slice's begin first) so
that slices nest; each event then needs one protobuf packet, which the builder fills one by one (a Python loop per
exported event: narrow big traces with --since/--until/--request).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from pdtrace.errors import UsageError
from pdtrace.export.model import ExportModel

INSTALL_HINT = "pip install perfetto"
_SEQ = 0x5D7  # one trusted packet sequence for all packets


def _builder_classes():
    try:
        # optional dependency (pdtrace[perfetto])
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent
        from perfetto.trace_builder.proto_builder import TraceProtoBuilder  # optional dependency (pdtrace[perfetto])
    except ImportError:
        raise UsageError(f"--to perfetto needs the optional perfetto package: {INSTALL_HINT} "
                         "(or use --to chrome, which ui.perfetto.dev opens too)") from None
    return TraceProtoBuilder, TrackEvent


def perfetto_bytes(model: ExportModel) -> bytes:
    """The serialised Perfetto `Trace` proto of the model."""
    TraceProtoBuilder, TrackEvent = _builder_classes()
    builder = TraceProtoBuilder()

    def descriptor(uuid: int) -> object:
        packet = builder.add_packet()
        packet.trusted_packet_sequence_id = _SEQ
        packet.track_descriptor.uuid = uuid
        return packet.track_descriptor

    # Track uuids: processes 1..P, threads and counters after them.
    process_uuid = {int(pid): int(pid) for pid in model.processes["pid"]}
    for pid, name in zip(model.processes["pid"], model.processes["name"], strict=True):  # per instance
        desc = descriptor(process_uuid[int(pid)])
        desc.process.pid = int(pid)
        desc.process.process_name = str(name)
    next_uuid = max(process_uuid.values(), default=0) + 1
    thread_uuid: dict[tuple[int, int], int] = {}
    threads = zip(model.threads["pid"], model.threads["tid"], model.threads["name"], strict=True)
    for pid, tid, name in threads:  # per thread
        thread_uuid[(int(pid), int(tid))] = next_uuid
        desc = descriptor(next_uuid)
        desc.parent_uuid = process_uuid[int(pid)]
        desc.thread.pid = int(pid)
        desc.thread.tid = int(tid)
        desc.thread.thread_name = str(name)
        next_uuid += 1

    # Slices: begin/end events sorted so that they nest.
    s = model.slices
    if len(s):
        uuid_by_key = pd.Series(list(thread_uuid.values()),
                                index=[(p << 32) + t for p, t in thread_uuid], dtype=np.int64)
        keys = (s["pid"].to_numpy(np.int64) << 32) + s["tid"].to_numpy(np.int64)
        tracks = uuid_by_key.reindex(keys).to_numpy(np.int64)
        begin = s["ts_ns"].to_numpy(np.int64)
        end = begin + np.maximum(s["dur_ns"].to_numpy(np.int64), 1)
        n = len(s)
        ts = np.concatenate([begin, end])
        is_begin = np.concatenate([np.ones(n, bool), np.zeros(n, bool)])
        # ends (0) before begins (1); among ends, the later-begun (inner) first; among begins, the longer first
        tie = np.concatenate([-end, -begin])
        order = np.lexsort((tie, is_begin, ts))
        index = np.concatenate([np.arange(n), np.arange(n)])[order]
        names = [str(v) for v in s["name"].to_numpy(dtype=object)]  # per slice
        cats = [str(v) for v in s["cat"].to_numpy(dtype=object)]
        is_send = np.asarray([v == "kv send" for v in names], bool)
        is_recv = np.asarray([v == "kv recv" for v in names], bool)
        flow_out = dict(zip(np.flatnonzero(is_send).tolist(), model.flows["id"].astype(int), strict=True))
        flow_in = dict(zip(np.flatnonzero(is_recv).tolist(), model.flows["id"].astype(int), strict=True))
        begin_type, end_type = TrackEvent.TYPE_SLICE_BEGIN, TrackEvent.TYPE_SLICE_END
        # Python ints and strs up front: indexing numpy arrays element by element costs more than the packet
        events = zip(index.tolist(), ts[order].tolist(), tracks[index].tolist(), is_begin[order].tolist(),
                     strict=True)
        for k, when, track, opens in events:  # one packet per event (see the module docstring)
            packet = builder.add_packet()
            packet.trusted_packet_sequence_id = _SEQ
            packet.timestamp = when
            event = packet.track_event
            event.track_uuid = track
            if opens:
                event.type = begin_type
                event.name = names[k]
                event.categories.append(cats[k])
                if k in flow_out:
                    event.flow_ids.append(flow_out[k])
                if k in flow_in:
                    event.terminating_flow_ids.append(flow_in[k])
            else:
                event.type = end_type

    # Counters: one track per (process, counter name, series).
    c = model.counters
    if len(c):
        for (pid, name), part in c.groupby(["pid", "name"], sort=True):  # per scheduler
            for series in model.counter_series:
                uuid = next_uuid
                next_uuid += 1
                desc = descriptor(uuid)
                desc.parent_uuid = process_uuid[int(pid)]
                desc.name = f"{name} {series.replace('_', ' ')}"
                desc.counter.unit_name = "blocks"
                samples = zip(part["ts_ns"].to_numpy(np.int64).tolist(), part[series].to_numpy(np.int64).tolist(),
                              strict=True)
                for when, value in samples:  # one packet per sample
                    packet = builder.add_packet()
                    packet.trusted_packet_sequence_id = _SEQ
                    packet.timestamp = when
                    event = packet.track_event
                    event.type = TrackEvent.TYPE_COUNTER
                    event.track_uuid = uuid
                    event.counter_value = value
    return builder.serialize()


def write_perfetto(model: ExportModel, path: str | Path) -> None:
    Path(path).write_bytes(perfetto_bytes(model))

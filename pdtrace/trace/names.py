"""Readable instance names: `prefill-0`, `decode-0`, `pd-0`, `engine-0` for what vLLM calls
`1796642343414415538` (its `instance_id`, `time.time_ns()` from 0.28) or a connector's uuid `engine_id`.

One fact, one function: `readable_names` turns, per instance, its role and first event time into its name.
Everything a user reads an instance by (the text report, `show`, `info`, plot labels, the export's processes) asks
it through `names_of(trace)` or `reader.footer_names(footers)`; the findings JSON keeps `instance` (vLLM's id, the
public contract) and adds `instance_name`.

The facts come from the whole trace's Parquet footers (`reader.footer_names`: the `role` and `ts_ns` row-group
statistics of every part file), never from the rows a command happens to load, so an instance has the same name
in a whole load, an `--instance` or `--since` read, one partition of a partitioned analysis, a window, a story's
filtered rows and `info`'s footer summary. A `Trace` read from a path carries them (`Trace.instance_names`); a
trace built in memory falls back to its own rows (`table_names`), the same facts when it holds the whole run.

The role is the `role` column (the engine's `kv_transfer_config.kv_role` as the recorder wrote it on every row,
the same value engine_config's `kv_role` holds: kv_producer -> prefill, kv_consumer -> decode, kv_both -> both,
no connector -> none), which unlike engine_config is in every writer's files and footers (a worker's alone, a
flight dump of one side).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from pdtrace.trace.model import dictionary_decoded

if TYPE_CHECKING:
    from pdtrace.trace.model import Trace

#: The word of a name per `role` value (docs/trace-format.md, "Instance names").
ROLE_WORDS = {"prefill": "prefill", "decode": "decode", "both": "pd", "none": "engine"}

#: Ids vLLM makes up: `instance_id` (`time.time_ns()` from 0.28, `random_uuid()[:5]` before), a connector's
#: `engine_id` (`uuid.uuid4()`), with or without dashes. Anything else is a name someone gave and is kept.
_GENERATED = re.compile(r"\d{6,}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}"
                        r"|(?=[0-9a-f]*\d)[0-9a-f]{5}", re.IGNORECASE)


def is_generated(instance: str) -> bool:
    """Whether an instance id is one vLLM made up (unreadable), rather than a name a person gave."""
    return _GENERATED.fullmatch(instance) is not None


def role_word(roles: Iterable[str]) -> str:
    """The word of an instance's name from the `role` values its rows carry (one, by the recorder; several only
    in a trace pieced together by hand: the first of prefill, decode, both that it holds)."""
    seen = {str(r) for r in roles}
    for role in ("prefill", "decode", "both"):
        if role in seen:
            return ROLE_WORDS[role]
    return ROLE_WORDS["none"]


def readable_names(facts: Mapping[str, tuple[Iterable[str], int | None]]) -> dict[str, str]:
    """instance -> its readable name, from instance -> (its `role` values, its first `ts_ns` or None).

    An instance whose id a person gave (`prefill-0` of the dry run, `--kv-transfer-config`'s engine_id) keeps it.
    The others get `<role word>-<index>`, the index counting the instances of that word from 0 in the order of
    their first event (ties, and no time, by id), skipping the names kept, so names are unique in the trace."""
    kept = {inst for inst in facts if not is_generated(inst)}
    names = {inst: inst for inst in kept}
    order = sorted((inst for inst in facts if inst not in kept),
                   key=lambda inst: (facts[inst][1] is None, facts[inst][1] or 0, inst))
    next_index: dict[str, int] = {}
    for inst in order:
        word = role_word(facts[inst][0])
        index = next_index.get(word, 0)
        while f"{word}-{index}" in kept:
            index += 1
        names[inst] = f"{word}-{index}"
        next_index[word] = index + 1
    return names


def table_facts(table: pa.Table) -> dict[str, tuple[set[str], int | None]]:
    """instance -> (roles, first ts_ns) of a table's rows (one group-by; `readable_names`' input)."""
    if table.num_rows == 0 or "instance" not in table.column_names:
        return {}
    keys = ["instance", "role"] if "role" in table.column_names else ["instance"]
    parts = {k: dictionary_decoded(table.column(k)) for k in keys}
    has_ts = "ts_ns" in table.column_names
    if has_ts:
        parts["ts_ns"] = table.column("ts_ns")
    grouped = pa.table(parts).group_by(keys).aggregate([("ts_ns", "min")] if has_ts else []).to_pylist()
    out: dict[str, tuple[set[str], int | None]] = {}
    for row in grouped:  # per (instance, role): few
        roles, first = out.get(str(row["instance"]), (set(), None))
        if row.get("role") is not None:
            roles.add(str(row["role"]))
        ts = row.get("ts_ns_min")
        out[str(row["instance"])] = (roles, ts if first is None else (first if ts is None else min(first, ts)))
    return out


def table_names(table: pa.Table) -> dict[str, str]:
    """The names from a table's own rows: an in-memory trace's (a loaded one carries its footers' names)."""
    return readable_names(table_facts(table))


def names_of(trace: "Trace") -> dict[str, str]:
    """instance -> readable name for a trace: the whole trace's, from its footers, where it was read from a path
    (`Trace.instance_names`), else from its rows. Every instance of the trace is in it."""
    names = getattr(trace, "instance_names", None)
    if names is None:
        names = table_names(trace.table)
        trace.instance_names = names
    elif "instance" in trace.table.column_names:
        present = pc.unique(dictionary_decoded(trace.table.column("instance"))).to_pylist()
        missing = [str(i) for i in present if i is not None and str(i) not in names]
        if missing:  # rows the footers did not name (never for a recorder's files): named after the others
            names = {**names, **{i: n for i, n in table_names(trace.table).items() if i in missing}}
    return names


def shown(names: Mapping[str, str], instance: object) -> str:
    """How an instance is printed: its readable name (the id itself where it has none)."""
    text = str(instance)
    return names.get(text, text)


def resolve_instance(given: str, names: Mapping[str, str]) -> str:
    """The instance id a user means by `given`: an id of the trace as it is, else the instance of that readable
    name, else `given` unchanged (the caller reports it as unknown)."""
    if given in names:
        return given
    for inst, name in names.items():
        if name == given:
            return inst
    return given


def resolve_instances(given: Iterable[str], names: Mapping[str, str]) -> list[str]:
    return [resolve_instance(g, names) for g in given]


def listing(names: Mapping[str, str], instances: Iterable[str] | None = None) -> str:
    """The instances for an error message: `name (id)` where they differ, sorted by name."""
    chosen = sorted(instances if instances is not None else names, key=lambda i: (shown(names, i), i))
    return ", ".join(shown(names, i) if shown(names, i) == i else f"{shown(names, i)} ({i})" for i in chosen)


__all__ = ["ROLE_WORDS", "is_generated", "readable_names", "table_facts", "table_names", "names_of", "shown",
           "resolve_instance", "resolve_instances", "listing", "role_word"]

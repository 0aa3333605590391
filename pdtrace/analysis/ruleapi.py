"""The rule author's surface: everything a rule imports from pdtrace, in one module (docs/writing-a-rule.md).

A rule module imports `from pdtrace.analysis.ruleapi import ...` and, besides, only the standard library, numpy and
pandas; every built-in rule does (tests/test_ruleapi.py reads their imports). This module only re-exports: each
name lives, documented, where it is built, and the old paths keep working. It sits above the modules it re-exports
and below the rules (tests/test_import_graph.py): no module it imports may import it or a rule.

What it holds, by use:
- declaring a rule: `Rule`, `CrossInstance`, `shared_table` (a table of one's own that other nodes may need);
- what a rule receives: `AnalysisContext` (`ctx.trace`, `ctx.config`, `ctx.cached`), `trace_span`;
- the event columns: `columns(ctx)` -> `Columns` (integer codes, the global order, request keys `rk` and
  scheduler keys `sk`), `NO` (the "none" index), and the sorted-lookup helpers `last_before`, `next_at_or_after`,
  `first_per_key`, `order_by_key`;
- the shared tables (built once per context): `request_state` (`RequestState`), `remote_flags`,
  `last_sched_before`, `request_table`; block `ownership`, `release_gaps`; `step_index`, `step_frame`,
  `step_table`, `exec_spans`, `busy_spans`, `gap_frame` and the detail readers; `history` (a trace that starts
  mid-run); `lifecycle_model` with its `INVARIANTS`;
- facts of the recorded vLLM release: `trace_behaviour`, `grace_s`, `nixl_send_lease_s`;
- shared judgement: `engine_configs`, `defer_block_free`, `gaps` (recorder gaps), `expected_ranks`,
  `rank_report`, `engine_failures` (`EngineFailure`, the crash policy, `CRASH_NOTE`), `DOWNGRADE`;
- findings: `FindingsBuilder` (fills instance, dp_rank, req, step, ts_ns and evidence from the rows a finding
  cites), `Evidence` (event refs), `fmt_blocks`, `groups`, `FINDING_COLUMNS`, `findings_frame`.
"""

from __future__ import annotations

from pdtrace.analysis.blocks import Ownership, ReleaseGaps, ownership, release_gaps
from pdtrace.analysis.columns import (NO, Columns, columns, first_per_key, last_before, last_per_key,
                                      next_at_or_after, order_by_key)
from pdtrace.analysis.context import AnalysisContext, trace_span
from pdtrace.analysis.findings import FINDING_COLUMNS, empty_findings, findings_frame
from pdtrace.analysis.history import history
from pdtrace.analysis.lifecycle import INVARIANTS, lifecycle_model
from pdtrace.analysis.parallel import shared_table
from pdtrace.analysis.registry import CrossInstance, Rule
from pdtrace.analysis.releases import grace_s, nixl_send_lease_s, trace_behaviour
from pdtrace.analysis.requests import RequestState, last_sched_before, remote_flags, request_state, request_table
from pdtrace.analysis.rulekit import (COMPLETION_FREE_REASONS, CRASH_NOTE, DOWNGRADE, FROM_ROWS, Cited, EngineFailure,
                                      Evidence, FindingsBuilder, Gaps, RankReport, StepIndex, declared_ranks,
                                      defer_block_free, engine_configs, engine_failures, expected_ranks, fmt_blocks,
                                      gaps, groups, inst_code_of_sk, int_column_at, rank_report, sk_instance,
                                      step_index)
from pdtrace.analysis.steps import (BUBBLE_CAUSES, busy_spans, config_numbers, detail_int, detail_number,
                                    detail_numbers, detail_text, exec_spans, gap_frame, instances, pipeline_sizes,
                                    rows_columns, sizes_of, step_frame, step_table)
from pdtrace.format import FINISHED_STATUSES

__all__ = [
    # declaring a rule
    "Rule", "CrossInstance", "shared_table",
    # what a rule receives
    "AnalysisContext", "trace_span",
    # the event columns
    "Columns", "columns", "NO", "last_before", "last_per_key", "next_at_or_after", "first_per_key", "order_by_key",
    # requests
    "RequestState", "request_state", "request_table", "remote_flags", "last_sched_before", "FINISHED_STATUSES",
    # blocks
    "Ownership", "ownership", "ReleaseGaps", "release_gaps",
    # steps and exec spans
    "StepIndex", "step_index", "step_frame", "step_table", "exec_spans", "busy_spans", "gap_frame", "BUBBLE_CAUSES",
    "instances", "pipeline_sizes", "config_numbers", "sizes_of", "rows_columns", "detail_int", "detail_number",
    "detail_numbers", "detail_text",
    # a trace that starts mid-run; the lifecycle model
    "history", "lifecycle_model", "INVARIANTS",
    # the recorded release
    "trace_behaviour", "grace_s", "nixl_send_lease_s",
    # shared judgement
    "engine_configs", "defer_block_free", "gaps", "Gaps", "expected_ranks", "declared_ranks", "rank_report",
    "RankReport", "engine_failures", "EngineFailure", "CRASH_NOTE", "DOWNGRADE", "COMPLETION_FREE_REASONS",
    "sk_instance", "inst_code_of_sk", "int_column_at",
    # findings
    "FindingsBuilder", "FROM_ROWS", "Cited", "Evidence", "fmt_blocks", "groups", "FINDING_COLUMNS", "findings_frame",
    "empty_findings",
]

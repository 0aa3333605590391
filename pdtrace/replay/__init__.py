"""`pdtrace replay TRACE`: re-drive a recorded run through the dry run on the installed vLLM, and say where the
scheduler's decisions part from the recording.

The algorithm:
1. Plan (`plan_replay`), from the recording alone:
   - topology: one scheduler without a connector (`single`), a producer (`p`) or a producer and a consumer (`pd`),
     from `engine_config`'s `kv_role`; its pool, block size, max_num_seqs, token budget, PP, TP and async
     scheduling from the first scheduler's `engine_config` (the dry run gives both sides one shape);
   - the workload, one request per request of the first scheduler in `req_add` order: its arrival (relative to
     the first), prompt length (`req_add` n), output length (D's sampled tokens in a pair, the engine's own
     otherwise: the steps that scheduled the request past its prompt), whether it stopped on EOS (`req_finish`
     reason `stop`), and a prefix shared with an earlier request where its first allocation had prefix-cache hits
     on blocks that request held (so vLLM's prefix cache finds them again);
   - what the client and the network did: each abort (`req_finish` reason `abort`) as an abort that many
     microseconds after the request reached its engine, each KV read's duration (D's `req_wait_kv` to its
     `kv_recv_done`) as `read_time`, the proxy's delay (median of P's finish to D's add);
   - the clock: compute per step fitted to the recorded steps (submit to output, least squares over the tokens
     scheduled, split over the PP stages), `schedule()`'s cost its recorded median.
2. Run the plan as a dry run (`pdtrace.dryrun`), the replayed trace kept where asked.
3. Compare (`compare_decisions`), per side: the sequence of the scheduler's non-empty decisions, each step's
   {request: tokens scheduled}, its preemptions and its frees (request, reason), the requests matched by their
   index in the workload. Empty steps are left out (how many a wait takes is the clock's, not a decision). A step
   matches when all three are equal; the report gives the share of matching steps (of the longer sequence) and
   the first step that differs, with what differs.
"""

from pdtrace.replay.compare import Decision, SideReport, compare_decisions, decisions
from pdtrace.replay.plan import ReplayPlan, plan_replay
from pdtrace.replay.run import ReplayResult, replay

__all__ = ["Decision", "ReplayPlan", "ReplayResult", "SideReport", "compare_decisions", "decisions",
           "plan_replay", "replay"]

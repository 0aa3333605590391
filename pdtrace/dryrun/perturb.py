"""Perturbations: the orderings `pdtrace chaos` forces on a dry run, each one a thing the real system can do.

A perturbation is a plain dict (JSON in a chaos failure's `failure.json`, `DryRunConfig.perturbations` in a run):
`kind` (a key of `PERTURBATIONS`), `req` (the workload index of the request it targets), and the parameters its
kind reads: `side` ("p": the prefill engine's request, "d": the decode engine's), `rank` (an index into the
engine's (pp, tp) ranks; -1: every rank), `steps`, `after_us`, `frac`, `factor`, `blocks`, `count`.

Every kind carries a label:
- LEGAL ("legal timing"): a correct connector, executor or client may do it (a client aborts at any moment, a
  rank reports a finished transfer some steps after another rank does, a read is slow or fails, the pool is small).
  A vLLM exception or an error finding under legal timing only is a vLLM bug (or a false alarm of pdtrace's).
- FAULTY ("faulty peer"): a connector or worker misbehaving (a completion lost, repeated, reported before the
  request finished, or for an id the engine never had). A failure that needs one is a robustness gap.

`Perturber` applies a run's perturbations inside the simulated cluster: at the workload (`burst`), at the delivery
of a request to an engine (`abort`), at the start of a read (`abort_in_read`, `slow_read`), and at each rank's
report of its finished transfers (`delay_report`, `fail_read`, `drop_report`, `dup_report`, `early_report`,
`unknown_report`). It draws nothing: the same perturbations and seed give the same trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdtrace.dryrun.sim import SimCluster, SimEngine
    from pdtrace.dryrun.workload import WorkloadRequest

LEGAL = "legal timing"
_NEVER_NS = 1 << 62
FAULTY = "faulty peer"
NS_PER_US = 1000


@dataclass(frozen=True)
class PerturbationKind:
    """One kind of perturbation: its label, what it does, and whether it needs a prefill/decode pair."""

    label: str
    does: str
    needs_pair: bool = True
    drawn: bool = True  # chaos draws it (False: only `pdtrace replay` sets it, from a recording)
    needs_offload: bool = False  # acts on the OffloadingConnector's store/load jobs (`--instances offload`)


PERTURBATIONS: dict[str, PerturbationKind] = {
    "burst": PerturbationKind(LEGAL, "requests req .. req+count-1 arrive at the same instant as request req",
                              needs_pair=False),
    "abort": PerturbationKind(LEGAL, "the client aborts request req on side p or d, after_us after that engine "
                              "received it (waiting, running, preempted, finished with its send pending, ...)",
                              needs_pair=False),
    "abort_in_read": PerturbationKind(LEGAL, "the client aborts D's request req at frac of its KV read's duration "
                                      "(frac > 1: after the read ended, around its completion's report)"),
    "delay_report": PerturbationKind(LEGAL, "rank reports req's finished transfer (side p: finished_sending, d: "
                                     "finished_recving) `steps` steps after it ended"),
    "slow_read": PerturbationKind(LEGAL, "req's KV read takes `factor` times longer"),
    "read_time": PerturbationKind(LEGAL, "req's KV read takes `us` microseconds (what `pdtrace replay` sets from "
                                  "the recording)", drawn=False),
    "recv_at_step": PerturbationKind(LEGAL, "D's ranks report req's read done at the end of the `steps`-th step after "
                                     "the one that started it (0: that step's own end; `pdtrace replay`)",
                                     drawn=False),
    "send_at_step": PerturbationKind(LEGAL, "P's ranks report req's send done at the end of the `steps`-th step from "
                                     "the one that registered it (`pdtrace replay`)", drawn=False),
    "fail_read": PerturbationKind(LEGAL, "req's KV read fails on rank: the rank reports its blocks invalid "
                                  "(invalid_block_ids) with the finished read"),
    "small_pool": PerturbationKind(LEGAL, "each instance's KV pool holds `blocks` blocks: preemption, queueing",
                                   needs_pair=False),
    "slow_store": PerturbationKind(LEGAL, "req's offloading stores (GPU to CPU) take `factor` times longer",
                                   needs_pair=False, needs_offload=True),
    "slow_load": PerturbationKind(LEGAL, "req's offloading loads (CPU to GPU) take `factor` times longer",
                                  needs_pair=False, needs_offload=True),
    "delay_job": PerturbationKind(LEGAL, "rank reports req's finished offloading jobs (`what`: store or load) "
                                  "`steps` steps after they ended", needs_pair=False, needs_offload=True),
    "drop_job": PerturbationKind(FAULTY, "rank never reports req's first finished offloading job (`what`: store "
                                 "or load)", needs_pair=False, needs_offload=True),
    "drop_report": PerturbationKind(FAULTY, "rank never reports req's finished transfer"),
    "dup_report": PerturbationKind(FAULTY, "rank reports req's finished transfer once more, `steps` steps later"),
    "early_report": PerturbationKind(FAULTY, "every P rank reports req's finished_sending at the end of the first "
                                     "step that schedules it (before it finished)"),
    "unknown_report": PerturbationKind(FAULTY, "rank reports a finished transfer (side p: sending, d: recving) for "
                                       "an id its engine never had"),
}


def label_of(perturbations: list[dict[str, Any]]) -> str:
    """A schedule's label: faulty peer if any of its perturbations is, else legal timing."""
    return FAULTY if any(PERTURBATIONS[p["kind"]].label == FAULTY for p in perturbations) else LEGAL


def check(perturbations: list[dict[str, Any]], requests: int, pair: bool, offload: bool = False) -> str | None:
    """What is wrong with a run's perturbations (one line), or None."""
    for p in perturbations:
        kind = PERTURBATIONS.get(p.get("kind", ""))
        if kind is None:
            return f"unknown perturbation {p.get('kind')!r}; known: {', '.join(PERTURBATIONS)}"
        if not 0 <= int(p.get("req", 0)) < requests:
            return f"perturbation {p['kind']} targets request {p.get('req')} of {requests}"
        if kind.needs_pair and not pair:
            return f"perturbation {p['kind']} needs a prefill/decode pair (--instances pd)"
        if kind.needs_offload and not offload:
            return f"perturbation {p['kind']} needs the offloading connector (--instances offload)"
    return None


def describe(p: dict[str, Any]) -> str:
    """One short line naming a perturbation and its parameters."""
    args = ", ".join(f"{k}={v}" for k, v in p.items() if k != "kind")
    return f"{p['kind']}({args})"


def draw(rng: random.Random, requests: int, pp: int, tp: int, pair: bool, count: int,
         offload: bool = False) -> list[dict[str, Any]]:
    """`count` perturbations drawn at random for a run of `requests` requests (the chaos runner's generator)."""
    kinds = [k for k, v in PERTURBATIONS.items()
             if v.drawn and (pair or not v.needs_pair) and (offload or not v.needs_offload)]
    ranks = pp * tp
    out: list[dict[str, Any]] = []
    for _ in range(count):
        kind = rng.choice(kinds)
        p: dict[str, Any] = {"kind": kind, "req": rng.randrange(requests)}
        side = rng.choice("pd") if pair else "p"
        rank = rng.choice([-1] + list(range(ranks))) if ranks > 1 else -1
        if kind == "burst":
            p["count"] = rng.randint(2, max(2, min(16, requests - p["req"])))
        elif kind == "abort":
            p.update(side=side, after_us=round(10 ** rng.uniform(1, 5.3), 1))  # 10 us .. 200 ms
        elif kind == "abort_in_read":
            p["frac"] = round(rng.uniform(0.0, 1.5), 3)
        elif kind in ("delay_report", "dup_report"):
            p.update(side=side, rank=rank, steps=rng.randint(1, 8))
        elif kind == "slow_read":
            p["factor"] = round(10 ** rng.uniform(0.5, 3), 1)
        elif kind == "fail_read":
            p["rank"] = rank
        elif kind == "small_pool":
            p["blocks"] = rng.choice([16, 24, 32, 48, 64])
        elif kind in ("drop_report", "unknown_report"):
            p.update(side=side, rank=rank)
        elif kind in ("slow_store", "slow_load"):
            p["factor"] = round(10 ** rng.uniform(0.5, 3), 1)
        elif kind == "delay_job":
            p.update(what=rng.choice(("store", "load")), rank=rank, steps=rng.randint(1, 8))
        elif kind == "drop_job":
            p.update(what=rng.choice(("store", "load")), rank=rank)
        out.append(p)
    return out


def apply_to_workload(perturbations: list[dict[str, Any]], workload: list[WorkloadRequest]) -> None:
    """`burst`: the requests it names arrive with its first."""
    for p in perturbations:
        if p["kind"] == "burst" and p["req"] < len(workload):
            at = workload[p["req"]].arrival_ns
            for w in workload[p["req"]: p["req"] + int(p.get("count", 2))]:
                w.arrival_ns = at
    workload.sort(key=lambda w: (w.arrival_ns, w.index))


def pool_blocks(perturbations: list[dict[str, Any]], num_blocks: int, needed: int) -> int:
    """The pool a `small_pool` perturbation leaves (never below what the longest request needs)."""
    for p in perturbations:
        if p["kind"] == "small_pool":
            num_blocks = min(num_blocks, max(int(p.get("blocks", 32)), needed))
    return num_blocks


class Perturber:
    """A run's perturbations, consulted by the simulated engines, ranks and transfer engine."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.items = list(cluster.config.perturbations)
        self.injected: list[str] = []
        self._held: list[list[Any]] = []  # [rank key, side, req id, steps left]
        self._applied: set[tuple[int, Any]] = set()  # (perturbation index, rank key)
        self._read_blocks: dict[str, tuple[int, ...]] = {}
        self._step_counts: dict[tuple[str, Any, str], int] = {}  # (instance, rank, req) -> rank ends to its report
        self._send_steps = {self._req(p, "p"): int(p.get("steps", 1)) for p in self._targets("send_at_step")}
        self._ended: dict[tuple[str, tuple[int, int]], int] = {}  # rank_end calls per (engine, rank)

    def _targets(self, kind: str) -> list[dict[str, Any]]:
        return [p for p in self.items if p["kind"] == kind]

    def _req(self, p: dict[str, Any], side: str | None = None) -> str:
        return self.cluster.req_id(f"r{int(p['req']):05d}", side or p.get("side", "p"))

    @staticmethod
    def _rank_matches(p: dict[str, Any], engine: SimEngine, rank: Any) -> bool:
        want = int(p.get("rank", -1))
        return want < 0 or engine.rank_keys[want % len(engine.rank_keys)] == (rank.pp_rank, rank.tp_rank)

    @staticmethod
    def _side_of(engine: SimEngine) -> str:
        return "d" if engine.role == "decode" else "p"

    # -- the engine's inputs -----------------------------------------------------------------------------------
    def on_added(self, engine: SimEngine, req_id: str, now: int) -> None:
        """A request reached `engine`: schedule the aborts that target it."""
        side = self._side_of(engine)
        for p in self._targets("abort"):
            if p.get("side", "p") == side and self._req(p) == req_id:
                engine.push_input(now + int(float(p.get("after_us", 0)) * NS_PER_US), "abort", req_id)
                self.injected.append(f"abort {req_id} {p.get('after_us')} us after it arrived")

    # -- the transfer engine -----------------------------------------------------------------------------------
    def read_ns(self, req_id: str, normal_ns: int) -> int:
        if any(self._req(p, "d") == req_id for p in self._targets("recv_at_step")):
            return _NEVER_NS  # its report comes at a step count (filter_reports), not at a time
        for p in self._targets("read_time"):
            if self._req(p, "d") == req_id:
                return int(float(p.get("us", 0)) * NS_PER_US)
        for p in self._targets("slow_read"):
            if self._req(p, "d") == req_id:
                return int(normal_ns * float(p.get("factor", 10)))
        return normal_ns

    def on_read_started(self, engine: SimEngine, req_id: str, ts: int, dur: int) -> None:
        for p in self._targets("recv_at_step"):
            if self._req(p, "d") == req_id:
                for key in engine.rank_keys:  # counted from this step's end on every rank
                    self._step_counts[(engine.instance, key, req_id)] = int(p.get("steps", 0)) + 1
        for p in self._targets("abort_in_read"):
            if self._req(p, "d") == req_id:
                engine.push_input(ts + int(dur * float(p.get("frac", 0.5))), "abort", req_id)
                self.injected.append(f"abort {req_id} at {p.get('frac')} of its read")

    # -- the ranks' reports ------------------------------------------------------------------------------------
    def _report_at_step(self, engine: SimEngine, rank: Any, key: Any, sends: set[str], recvs: set[str]) -> None:
        """recv_at_step / send_at_step: count this rank's step ends; report what is due now."""
        if self._send_steps and self._side_of(engine) == "p":
            for req_id, steps in self._send_steps.items():
                k = (engine.instance, key[1], req_id)
                if k not in self._step_counts and req_id in rank.sends_registered:
                    self._step_counts[k] = steps
        for k in [k for k in self._step_counts if k[0] == engine.instance and k[1] == key[1]]:
            self._step_counts[k] -= 1
            if self._step_counts[k] <= 0:
                del self._step_counts[k]
                if self._side_of(engine) == "p":
                    sends.add(k[2])
                    rank.sends_registered.discard(k[2])
                    rank.done_sends[:] = [(t, r) for t, r in rank.done_sends if r != k[2]]
                else:
                    recvs.add(k[2])
                    rank.done_recvs[:] = [(t, r) for t, r in rank.done_recvs if r != k[2]]

    def note_read(self, req_id: str, block_ids: Any) -> None:
        """D's local blocks of a read (flat, or one list per KV cache group): what a failed read reports."""
        flat: list[int] = []
        for b in block_ids or ():
            flat.extend(b) if isinstance(b, (list, tuple)) else flat.append(b)
        self._read_blocks[req_id] = tuple(int(b) for b in flat)

    def filter_reports(self, engine: SimEngine, rank: Any, rec: Any, sends: set[str],
                       recvs: set[str]) -> tuple[set[str], set[str], set[int]]:
        """A rank's finished sends and receives after the perturbations, and the block ids it reports invalid."""
        if not self.items:
            return sends, recvs, set()
        key = (engine.instance, (rank.pp_rank, rank.tp_rank))
        self._ended[key] = n = self._ended.get(key, 0) + 1
        side = self._side_of(engine)
        sends, recvs = set(sends), set(recvs)
        invalid: set[int] = set()
        # what was held back earlier and is due now
        if self._step_counts or self._send_steps:
            self._report_at_step(engine, rank, key, sends, recvs)
        due = [h for h in self._held if h[0] == key and h[3] <= 1]
        for h in self._held:
            if h[0] == key:
                h[3] -= 1
        self._held = [h for h in self._held if h[3] > 0]
        for _, held_side, req_id, _ in due:
            (sends if held_side == "p" else recvs).add(req_id)
        mine = sends if side == "p" else recvs
        for i, p in enumerate(self.items):
            kind = p["kind"]
            if kind in ("delay_report", "drop_report", "dup_report", "unknown_report") and p.get("side") != side:
                continue
            if kind in ("delay_report", "fail_read", "drop_report", "dup_report", "unknown_report") \
                    and not self._rank_matches(p, engine, rank):
                continue
            if (i, key) in self._applied:  # each perturbation acts once per rank
                continue
            if kind == "early_report":
                target = self._req(p, "p")
                if side == "p" and rec.forward and target in getattr(rec.so, "num_scheduled_tokens", {}):
                    self._applied.add((i, key))
                    sends.add(target)
                    rank.sends_registered.discard(target)
                    self.injected.append(f"rank {key[1]} reports {target} sent in step {rec.step}")
                continue
            if kind == "unknown_report":
                if n == 1 + int(p["req"]) % 7:
                    self._applied.add((i, key))
                    mine.add(f"{self._req(p)}-unknown")
                    self.injected.append(f"rank {key[1]} reports unknown id {self._req(p)}-unknown")
                continue
            target = self._req(p, "d" if kind == "fail_read" else None)
            if kind == "fail_read":
                if side == "d" and target in recvs:
                    self._applied.add((i, key))
                    invalid.update(self._read_blocks.get(target, ()))
                    self.injected.append(f"rank {key[1]} fails the read of {target}")
                continue
            if target not in mine:
                continue
            self._applied.add((i, key))
            if kind == "delay_report":
                mine.discard(target)
                self._held.append([key, side, target, int(p.get("steps", 1))])
                self.injected.append(f"rank {key[1]} reports {target} {p.get('steps')} step(s) late")
            elif kind == "drop_report":
                mine.discard(target)
                self.injected.append(f"rank {key[1]} never reports {target}")
            elif kind == "dup_report":
                self._held.append([key, side, target, int(p.get("steps", 1))])
                self.injected.append(f"rank {key[1]} reports {target} again {p.get('steps')} step(s) later")
        return sends, recvs, invalid

    # -- the offloading workers (`--instances offload`) --------------------------------------------------------
    def offload_factor(self, req_id: str, is_load: bool) -> float:
        """How many times longer req's store (or load) takes: slow_store / slow_load."""
        kind = "slow_load" if is_load else "slow_store"
        factor = 1.0
        for p in self._targets(kind):
            if self._req(p) == req_id:
                factor *= float(p.get("factor", 10))
        return factor

    def offload_report(self, engine: SimEngine, rank: Any, req_id: str, is_load: bool) -> int | None:
        """When a rank reports a finished offloading job of req: 0 at once, k steps later (delay_job), or None:
        never (drop_job, once per rank)."""
        what = "load" if is_load else "store"
        key = (engine.instance, (rank.pp_rank, rank.tp_rank))
        delay = 0
        for i, p in enumerate(self.items):
            if p["kind"] not in ("delay_job", "drop_job") or p.get("what", "store") != what:
                continue
            if self._req(p) != req_id or not self._rank_matches(p, engine, rank):
                continue
            if p["kind"] == "drop_job":
                if (i, key) in self._applied:
                    continue
                self._applied.add((i, key))
                self.injected.append(f"rank {key[1]} never reports a {what} of {req_id}")
                return None
            delay = max(delay, int(p.get("steps", 1)))
        if delay:
            self.injected.append(f"rank {key[1]} reports a {what} of {req_id} {delay} step(s) late")
        return delay

"""One chaos trial: drawn from a seed, run on the installed vLLM, judged."""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pdtrace.dryrun import run_dry_run
from pdtrace.dryrun.config import DryRunConfig
from pdtrace.dryrun.perturb import draw, label_of
from pdtrace.errors import PdtraceError

#: The campaign's workloads: the topology every trial of it shares (the rest is drawn per trial).
WORKLOADS: dict[str, dict[str, Any]] = {
    "pd": {"instances": "pd", "pp": 1},
    "pp": {"instances": "pd", "pp": 2},
    "single": {"instances": "single", "pp": 1},
    "offload": {"instances": "offload", "pp": 1},  # vLLM's OffloadingConnector (CPU), vLLM 0.23+
}

#: Long enough that a leak outlasts the leak rules' grace (480 s) before the trace ends.
END_HOLD_S = 600.0
#: Virtual time without progress after which a trial is judged stuck: above the slowest read a `slow_read` makes
#: (1000 x a read of ~0.7 ms), so a slow transfer is not taken for a hang (the dry run's default is 300 ms).
DRAIN_MS = 2000.0


def draw_trial(rng: random.Random, workload: str, async_ok: bool = True) -> DryRunConfig:
    """A small dry run with 1 to 4 perturbations, every choice from `rng` (the campaign's seed decides them all)."""
    shape = WORKLOADS[workload]
    pair = shape["instances"] == "pd"
    pp = shape["pp"]
    tp = rng.choice((1, 1, 2)) if pair else 1
    requests = rng.randint(4, 24)
    config = DryRunConfig(
        instances=shape["instances"], pp=pp, tp=tp, requests=requests,
        rate=rng.choice((0.0, 200.0, 2000.0)),
        prompt_len=f"uniform:8:{rng.choice((48, 160, 400))}",
        output_len=rng.choice(("exp:4", "exp:16", "uniform:1:40")),
        num_blocks=512, max_num_seqs=rng.choice((4, 16, 64)),
        max_num_batched_tokens=rng.choice((64, 128, 512)),
        async_scheduling=async_ok and pp == 1 and rng.random() < 0.3,
        enable_prefix_caching=rng.random() < 0.7,
        seed=rng.randrange(1 << 31), end_hold_s=END_HOLD_S, drain_timeout_ms=DRAIN_MS)
    offload = shape["instances"] == "offload"
    if offload:  # drawn after the others so the other workloads' trials stay what they were
        # Shared prefixes and a pool that evicts them: the CPU holds what the GPU lost, so requests load from it.
        config.shared_prefix = rng.choice((0.3, 0.6, 0.9))
        config.num_blocks = rng.choice((48, 96, 512))
    config.perturbations = draw(rng, requests, pp, tp, pair, rng.randint(1, 4), offload=offload)
    if config.async_scheduling:
        # Async trials cap a prefill's chunk (vLLM's long_prefill_token_threshold, what
        # --max-num-partial-prefills > 1 sets): a running prefill then leaves room for a later request to finish its
        # whole prompt in the same step, and be the next step's preemption victim while that step is in flight
        # (vLLM #50297). Drawn from the trial's own seed, so the campaign's draws, and every trial without async
        # scheduling, stay what they were before this shape was added. KV pressure comes with it (long prompts, at
        # least 12 requests, a small pool unless one was drawn): P's pool must run short while the step that
        # finishes the victim's prefill is in flight; on 0.26.0 the seed-0 trials with prompts up to 48 or 160
        # tokens never filled it, the first with prompts up to 400 did.
        # Trials that abort are left as they were: seed 0's finds of vLLM #32255 and #25562 (docs/chaos.md) are.
        own = random.Random(config.seed)
        aborts = any(p["kind"] in ("abort", "abort_in_read") for p in config.perturbations)
        if not aborts:
            # below the step's budget: a cap at or above it changes nothing
            caps = [t for t in (16, 32, 64) if t < config.max_num_batched_tokens]
            config.long_prefill_token_threshold = own.choice(caps)
            config.prompt_len = "uniform:8:400"
            config.requests = max(config.requests, 12)
            blocks = own.choice((16, 24, 32, 48))
            if not any(p["kind"] == "small_pool" for p in config.perturbations):
                config.perturbations.append({"kind": "small_pool", "req": 0, "blocks": blocks})
    return config


@dataclass
class Outcome:
    """A trial's verdict. `signature` is None when it passed: neither vLLM raised nor `analyze` found an error."""

    signature: str | None
    label: str
    detail: str = ""
    traceback: str | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)  # the error findings (rule, subrule, req, message)
    harness_error: str | None = None  # the dry run itself could not run this trial (not a vLLM failure)
    wall_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.signature is not None


_FRAME = re.compile(r'File "(?P<file>[^"]*?/vllm/[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def raise_signature(error: str, traceback: str | None) -> str:
    """`ExcType at vllm/<path>:<function>`: the innermost vLLM frame of the traceback (no line number, so one bug
    keeps one signature across releases); the error line's own site where no traceback was kept."""
    last = (traceback or "").strip().splitlines()[-1:] or [""]
    named = re.match(r"^([\w.]+)(?::|$)", last[0]) or re.match(r"^\S+: ([\w.]+)", error)
    exc_type = named.group(1).rsplit(".", 1)[-1] if named else error
    frames = list(_FRAME.finditer(traceback or ""))
    if frames:
        f = frames[-1]
        path = f["file"][f["file"].rindex("/vllm/") + 1:]
        return f"{exc_type} at {path}:{f['func']}"
    return exc_type


def judge(error: str | None, traceback: str | None, findings: Any, label: str) -> Outcome:
    """The verdict on one run: vLLM's exception first (its signature), else the first error finding's rule/subrule
    (the findings sorted by rule, subrule)."""
    errors: list[dict[str, Any]] = []
    if findings is not None and len(findings):
        rows = findings[findings["severity"] == "error"]
        errors = [{"rule": r.rule, "subrule": r.subrule, "instance": r.instance, "req": r.req,
                   "message": str(r.message)} for r in rows.itertuples()]
        errors.sort(key=lambda f: (f["rule"], f["subrule"]))
    if error:
        return Outcome(raise_signature(error, traceback), label, error, traceback, errors)
    if errors:
        first = errors[0]
        return Outcome(f"{first['rule']}/{first['subrule']}", label, first["message"], None, errors)
    return Outcome(None, label)


Spawner = Callable[[list[str], dict[str, str]], "tuple[int, str]"]


def run_trial(config: DryRunConfig, out: Path, spawn: Spawner | None = None) -> Outcome:
    """Run `config` into `out` (a new directory) and judge it. A trial the dry run refuses or cannot finish is an
    Outcome with `harness_error` (and no signature): pdtrace's problem, not vLLM's."""
    from pdtrace.analysis import analyze  # lazy: `import pdtrace.chaos` loads no analysis stack (600 modules)

    label = label_of(config.perturbations)
    t0 = time.perf_counter()
    try:
        result = run_dry_run(config, out, spawn=spawn)
    except PdtraceError as exc:
        return Outcome(None, label, harness_error=str(exc), wall_s=time.perf_counter() - t0)
    try:
        findings = analyze(out)
    except PdtraceError as exc:
        return Outcome(None, label, harness_error=f"analyze: {exc}", wall_s=time.perf_counter() - t0)
    outcome = judge(result.error, result.traceback, findings, label)
    outcome.wall_s = time.perf_counter() - t0
    return outcome

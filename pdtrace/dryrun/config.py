"""The dry run's configuration: topology, workload, simulated timings and faults (no vLLM import here).

`DryRunConfig.validate()` refuses what real vLLM 0.33.0 refuses (the V1 model runner with pipeline parallelism and
async scheduling together, config/vllm.py:1665-1681) and what a fault needs but the topology lacks.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdtrace.errors import UsageError

#: Fault names, each reproducing one real class of incident (see pdtrace/dryrun/faults.py).
FAULTS: dict[str, str] = {
    "completion_before_finish": "P workers report finished_sending for a request whose prefill is still running "
    "(vLLM asserts request.is_finished() in _free_blocks)",
    "lost_send_completion": "P workers never report finished_sending for one request: its delayed free leaks",
    "abort_while_waiting_kv": "a D request is aborted while WAITING_FOR_REMOTE_KVS, its read still in flight",
    "duplicate_completion": "P rank 0 reports finished_sending for one request a second time, one step later "
    "(with several ranks: before the others report, so the aggregator completes early)",
    "missing_rank_completion": "the last TP rank of P never reports finished_sending for one request",
    "slow_transfer": "one request's KV read takes far longer than the run: D waits for KV until the end",
    "starve": "a head-of-line request whose prompt needs more blocks than the pool holds never fits",
    "few_requests_pp": "fewer ready requests than PP stages (requests arrive one at a time): pipeline bubbles",
}

INSTANCE_LAYOUTS = ("pd", "p", "single", "offload")

_DIST_RE = re.compile(r"^(?:(?P<fixed>\d+)|uniform:(?P<lo>\d+):(?P<hi>\d+)|exp:(?P<mean>\d+(?:\.\d+)?))$")


def parse_length_distribution(spec: str | int) -> tuple[str, float, float]:
    """Parse a length distribution: `N` (fixed), `uniform:A:B` (inclusive) or `exp:MEAN` (exponential, >= 1)."""
    if isinstance(spec, int):
        spec = str(spec)
    m = _DIST_RE.match(spec.strip())
    if not m:
        raise UsageError(f"bad length distribution {spec!r}: use N, uniform:A:B or exp:MEAN")
    if m.group("fixed") is not None:
        n = int(m.group("fixed"))
        if n < 1:
            raise UsageError(f"bad length distribution {spec!r}: lengths are at least 1")
        return ("fixed", n, n)
    if m.group("lo") is not None:
        lo, hi = int(m.group("lo")), int(m.group("hi"))
        if lo < 1 or hi < lo:
            raise UsageError(f"bad length distribution {spec!r}: need 1 <= A <= B")
        return ("uniform", lo, hi)
    mean = float(m.group("mean"))
    if mean < 1:
        raise UsageError(f"bad length distribution {spec!r}: the mean is at least 1")
    return ("exp", mean, mean)


def distribution_max(spec: str | int) -> int:
    """An upper bound used to size max_model_len (exponential: 8x the mean, where draws are clipped)."""
    kind, a, b = parse_length_distribution(spec)
    return int(b) if kind != "exp" else int(8 * a) + 1


#: The first release whose OffloadingConnector reports completions per job (`OffloadingWorkerMetadata`, vLLM
#: #39186), the protocol pdtrace/dryrun/offload.py simulates: checked in 0.23.0 (and 0.25.1 to 0.33.0); 0.17.1 and
#: earlier report per request. The releases between were not checked: where vLLM's files are at hand they decide.
OFFLOAD_MIN_VLLM = (0, 23)
_WORKER_METADATA = "distributed/kv_transfer/kv_connector/v1/offloading/common.py"


def offload_supported(version: str | None) -> bool:
    """Whether the dry run simulates the OffloadingConnector of the installed vLLM (release `version`): its files
    define `OffloadingWorkerMetadata` (read as text: vLLM is not imported), or where they cannot be read, the
    release is 0.23 or later (an unknown version: yes, and the run says so if not)."""
    in_files = _offload_protocol_in_files()
    if in_files is not None:
        return in_files
    try:
        release = tuple(int(x) for x in (version or "").split(".")[:2])
    except ValueError:
        return True
    return not version or release >= OFFLOAD_MIN_VLLM


def _offload_protocol_in_files() -> bool | None:
    """Whether the installed vLLM's files define `OffloadingWorkerMetadata`; None where there are no vLLM files."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            return "class OffloadingWorkerMetadata" in (Path(root) / _WORKER_METADATA).read_text()
        except OSError:
            return False  # no offloading/ package: an OffloadingConnector that reports per request, or none
    return None


def check_offload() -> None:
    """UsageError (one line) where the installed vLLM's OffloadingConnector is not the one the dry run simulates."""
    # lazy: the CLI imports this module at start; no hook tables then
    from pdtrace.recording.vllm import installed_vllm_version

    version = installed_vllm_version()
    if not offload_supported(version):
        raise UsageError(f"--instances offload needs vLLM 0.23 or later (its OffloadingConnector reports stores and "
                         f"loads per job; earlier ones report them per request); this is vLLM {version}")


@dataclass
class DryRunConfig:
    """Everything a dry run needs. Times are virtual (the recorder's injectable clock), never wall-clock."""

    # topology
    pp: int = 1
    tp: int = 1
    instances: str = "pd"  # "pd": one prefill and one decode engine; "p": prefill only; "single": aggregated;
    # "offload": one engine with the OffloadingConnector (pdtrace/dryrun/offload.py)
    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # vLLM's chunk cap per request and step (0: none; what --max-num-partial-prefills > 1 sets to 4 % of the
    # model length): a prefill chunked below the budget leaves room for a later request in the same step
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False
    enable_prefix_caching: bool = True
    # workload
    requests: int = 32
    rate: float = 50.0  # requests per virtual second (Poisson); <= 0: all arrive at t=0
    prompt_len: str = "uniform:64:256"
    output_len: str = "exp:32"
    seed: int = 0
    shared_prefix: float = 0.0  # share of requests whose prompt starts with an earlier request's (prefix hits)
    # simulated cluster (virtual time)
    transfer_latency_us_per_block: float = 20.0  # KV read time per block (latency part)
    transfer_setup_us: float = 200.0  # fixed cost per read (handshake amortised, RDMA post, notification)
    transfer_bandwidth_gbps: float = 0.0  # > 0 adds bytes / bandwidth, with `kv_bytes_per_block`
    kv_bytes_per_block: int = 2 * 1024 * 1024
    compute_us_per_token: float = 20.0  # per PP stage: a stage does 1/pp of the layers
    compute_us_fixed: float = 400.0  # per PP stage and step (kernel launches, sampling share)
    sched_cost_us: float = 150.0  # simulated CPU time of one schedule() (fixed: same seed, same trace)
    sched_cost_us_per_req: float = 4.0  # plus this per scheduled request
    update_cost_us_per_req: float = 3.0  # update_from_output CPU time per request in the step
    idle_sleep_us: float = 1000.0  # vLLM's time.sleep(0.001) after a step that executed nothing (core.py:1693)
    proxy_delay_us: float = 500.0  # P output -> proxy -> D request
    drain_timeout_ms: float = 300.0  # stop once nothing progressed for this long (virtual) after the last arrival
    max_virtual_s: float = 3600.0  # hard stop
    # When the run ends stuck (a leak, a starved or stuck request), the engines jump this far ahead and take one
    # more step, so that a trace shows waits longer than the analyzer's grace period without simulating the
    # ~1000 empty steps a second vLLM runs meanwhile (core.py:1693). 0: end at the drain timeout.
    end_hold_s: float = 0.0
    faults: list[str] = field(default_factory=list)
    fault_request: int = -1  # index of the request a fault targets; -1: picked by the fault
    slow_transfer_ms: float = 5000.0  # the slow_transfer fault's read time
    real_scheduler_time: bool = False  # add the scheduler's measured CPU time instead (not deterministic)
    instance_prefix: str = ""  # instance ids: "<prefix>prefill-0", "<prefix>decode-0", "<prefix>engine-0"
    # orderings forced on the run (pdtrace.dryrun.perturb; what `pdtrace chaos` draws): plain dicts, JSON-able
    perturbations: list[dict[str, Any]] = field(default_factory=list)
    # the workload's requests given instead of drawn (what `pdtrace replay` reads off a recording): dicts with
    # `arrival_us`, `prompt_len`, `max_tokens`, and optionally `eos` and `prefix` = [earlier request, tokens shared]
    given_requests: list[dict[str, Any]] = field(default_factory=list)

    def validate(self) -> DryRunConfig:
        """Check the configuration; raise UsageError (exit 2) with one line naming the option."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise UsageError(msg)

        need(self.pp >= 1 and self.tp >= 1, "--pp and --tp must be at least 1")
        need(self.instances in INSTANCE_LAYOUTS, f"--instances must be one of {', '.join(INSTANCE_LAYOUTS)}")
        need(self.num_blocks >= 4, "--num-blocks must be at least 4")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             "--block-size must be a power of two")
        need(self.max_num_seqs >= 1, "--max-num-seqs must be at least 1")
        need(self.max_num_batched_tokens >= self.block_size, "--max-num-batched-tokens must be >= --block-size")
        need(self.long_prefill_token_threshold >= 0, "--long-prefill-token-threshold must be >= 0")
        need(self.requests >= 1, "--requests must be at least 1")
        need(self.end_hold_s >= 0, "--end-hold-s must be >= 0")
        need(0.0 <= self.shared_prefix <= 1.0, "--shared-prefix must be between 0 and 1")
        parse_length_distribution(self.prompt_len)
        parse_length_distribution(self.output_len)
        if self.async_scheduling and self.pp > 1:
            # Real vLLM 0.33.0 raises this for the V1 model runner, which is what a dry run simulates.
            raise UsageError("Async scheduling is not supported by the V1 model runner with pipeline parallelism "
                             "(vLLM 0.33.0 rejects --async-scheduling with --pp > 1)")
        unknown = [f for f in self.faults if f not in FAULTS]
        need(not unknown, f"unknown fault {', '.join(unknown)}; known: {', '.join(FAULTS)}")
        pd_faults = {"completion_before_finish", "lost_send_completion", "abort_while_waiting_kv",
                     "duplicate_completion", "missing_rank_completion", "slow_transfer"}
        bad = sorted(pd_faults & set(self.faults))
        if bad and self.instances in ("single", "offload"):
            raise UsageError(f"fault {bad[0]} needs a prefill/decode pair (--instances pd or p)")
        d_faults = sorted({"abort_while_waiting_kv", "slow_transfer"} & set(self.faults))
        if d_faults and self.instances != "pd":
            raise UsageError(f"fault {d_faults[0]} needs a decode instance (--instances pd)")
        if "missing_rank_completion" in self.faults:
            need(self.pp * self.tp >= 2, "fault missing_rank_completion needs --tp or --pp of at least 2")
        if "few_requests_pp" in self.faults:
            need(self.pp >= 2, "fault few_requests_pp needs --pp of at least 2")
        if "starve" in self.faults:
            need(self.instances not in ("single", "offload"), "fault starve needs a prefill instance that holds "
                 "blocks for its decoder (--instances pd or p)")
            # The starving prompt must come in one chunk: chunked, it would run and preempt itself instead.
            pool = (self.num_blocks - 1) * self.block_size
            need(self.max_num_batched_tokens >= pool,
                 f"fault starve needs --max-num-batched-tokens >= (--num-blocks - 1) x --block-size ({pool})")
            need(distribution_max(self.prompt_len) + distribution_max(self.output_len) <= pool,
                 "fault starve needs the other requests to fit the pool: lower --prompt-len/--output-len or "
                 "raise --num-blocks")
        for i, r in enumerate(self.given_requests):
            need(isinstance(r, dict) and int(r.get("prompt_len", 0)) >= 1 and int(r.get("max_tokens", 0)) >= 1
                 and float(r.get("arrival_us", -1)) >= 0,
                 f"given request {i} needs arrival_us >= 0, prompt_len >= 1 and max_tokens >= 1")
        if self.given_requests:
            self.requests = len(self.given_requests)
        # lazy: the CLI imports this module at start; the orderings' module only when a config is validated
        from pdtrace.dryrun.perturb import check

        problem = check(self.perturbations, self.requests, pair=self.instances == "pd",
                        offload=self.instances == "offload")
        need(problem is None, str(problem))
        if self.instances == "offload":
            check_offload()
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for the manifest and the result)."""
        return asdict(self)


#: One-line help per option of `pdtrace record --dry-run` (option name = field name with dashes; `--fault` is
#: repeatable and fills `faults`; booleans are `--x/--no-x`).
FIELD_HELP: dict[str, str] = {
    "pp": "Pipeline-parallel stages per instance.",
    "tp": "Tensor-parallel ranks per stage.",
    "instances": "pd: a prefill and a decode instance (1P1D); p: prefill only (a phantom decoder reads the KV); "
                 "single: one aggregated engine without a connector; offload: one engine with vLLM's "
                 "OffloadingConnector (CPU offloading, simulated workers; vLLM 0.23+).",
    "num_blocks": "KV blocks in each instance's pool (vLLM's num_gpu_blocks_override).",
    "block_size": "Tokens per KV block.",
    "max_num_seqs": "vLLM's max_num_seqs.",
    "max_num_batched_tokens": "vLLM's token budget per step (chunked prefill above it).",
    "long_prefill_token_threshold": "vLLM's cap on one request's prefill chunk per step (0: none).",
    "async_scheduling": "vLLM's async scheduling (refused with --pp > 1, as vLLM 0.33's V1 runner does).",
    "enable_prefix_caching": "vLLM's prefix caching.",
    "requests": "Client requests in the workload.",
    "rate": "Arrival rate, requests per virtual second (Poisson); 0: all at once.",
    "prompt_len": "Prompt lengths: N, uniform:A:B or exp:MEAN.",
    "output_len": "Output lengths: N, uniform:A:B or exp:MEAN (half the requests end with EOS, half by length).",
    "seed": "Seed of the workload and the sampled tokens: same seed, same trace.",
    "shared_prefix": "Share of requests (0 to 1) whose prompt starts with half of an earlier request's prompt: "
                     "prefix-cache hits, and with --instances offload loads from the CPU.",
    "transfer_latency_us_per_block": "Simulated KV read time per block, microseconds.",
    "transfer_setup_us": "Simulated fixed cost per KV read, microseconds.",
    "transfer_bandwidth_gbps": "Simulated link bandwidth, Gbit/s (0: latency model only).",
    "kv_bytes_per_block": "Bytes per KV block, for the bandwidth model.",
    "compute_us_per_token": "Simulated compute per token per PP stage, microseconds.",
    "compute_us_fixed": "Simulated fixed compute per step per PP stage, microseconds.",
    "sched_cost_us": "Simulated CPU time of one schedule(), microseconds.",
    "sched_cost_us_per_req": "Simulated schedule() time per scheduled request, microseconds.",
    "update_cost_us_per_req": "Simulated update_from_output() time per request, microseconds.",
    "idle_sleep_us": "Sleep after a step that executed nothing (vLLM: 1000).",
    "proxy_delay_us": "Proxy delay from P's output to D's request, microseconds.",
    "drain_timeout_ms": "Stop once nothing progressed for this long (virtual ms) after the last arrival.",
    "max_virtual_s": "Hard stop, virtual seconds.",
    "end_hold_s": "When the run ends stuck, jump this far ahead and step once (leaks outlast the grace period).",
    "faults": "Inject a fault (repeatable): " + ", ".join(FAULTS) + ".",
    "fault_request": "Index of the workload request a fault targets (default: chosen by the fault).",
    "slow_transfer_ms": "The slow_transfer fault's read time, ms.",
    "real_scheduler_time": "Charge the scheduler's measured CPU time instead of the fixed costs (not deterministic).",
    "instance_prefix": "Prefix of the instance ids (prefill-0, decode-0, engine-0).",
    "given_requests": "A workload request given instead of drawn (repeatable; replaces --requests, --rate and the "
                      "lengths), a JSON object such as '{\"arrival_us\": 0, \"prompt_len\": 100, \"max_tokens\": 8}'"
                      " (optional: \"eos\", \"prefix\": [earlier request, tokens shared]).",
    "perturbations": "Force an ordering (repeatable), a JSON object as `pdtrace chaos` writes them, e.g. "
                     "'{\"kind\": \"abort\", \"req\": 3, \"side\": \"d\", \"after_us\": 50}' (kinds: "
                     "pdtrace/dryrun/perturb.py).",
}

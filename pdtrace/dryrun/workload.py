"""The dry run's workload: arrival times and prompt/output lengths drawn from one seeded `random.Random`.

Only the standard library's generator is used, so the same seed gives the same requests on every platform.
Prompt tokens are random ids below 30000 (never the model's EOS id 50256), so prefix-cache hits are rare.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdtrace.dryrun.config import DryRunConfig, parse_length_distribution

EOS_TOKEN_ID = 50256
VOCAB_FOR_PROMPTS = 30000


@dataclass
class WorkloadRequest:
    """One client request of the workload."""

    index: int
    arrival_ns: int  # virtual time relative to the start of the run
    prompt_token_ids: list[int]
    max_tokens: int
    eos: bool | None = None  # ends with EOS at max_tokens (else by length); None: every other request does
    first_step: int = -1  # replay: the step of the first engine (P, or the only one) it was added before
    decode_step: int = -1  # replay: likewise on D

    def wants_eos(self) -> bool:
        return self.index % 2 == 0 if self.eos is None else self.eos


def draw_length(rng: random.Random, spec: str | int) -> int:
    """One draw from a length distribution (see config.parse_length_distribution)."""
    kind, a, b = parse_length_distribution(spec)
    if kind == "fixed":
        return int(a)
    if kind == "uniform":
        return rng.randint(int(a), int(b))
    return max(1, min(int(8 * a), int(round(rng.expovariate(1.0 / a)))))


def make_workload(config: DryRunConfig) -> list[WorkloadRequest]:
    """The requests of a run, in arrival order. Faults may reshape one of them afterwards (faults.py)."""
    if config.given_requests:
        return given_workload(config)
    rng = random.Random(config.seed)
    out: list[WorkloadRequest] = []
    t = 0.0
    for i in range(config.requests):
        if config.rate > 0 and i > 0:
            t += rng.expovariate(config.rate)
        prompt_len = draw_length(rng, config.prompt_len)
        max_tokens = draw_length(rng, config.output_len)
        tokens = [rng.randrange(VOCAB_FOR_PROMPTS) for _ in range(prompt_len)]
        out.append(WorkloadRequest(i, int(t * 1e9), tokens, max_tokens))
    if config.shared_prefix > 0:
        share_prefixes(out, config.shared_prefix, config.seed)
    return out


def share_prefixes(out: list[WorkloadRequest], share: float, seed: int) -> None:
    """`share` of the requests (after the first) start with the first half of an earlier request's prompt. Its own
    generator, so that a run without shared prefixes draws exactly what it drew before the option existed."""
    rng = random.Random(seed ^ 0x5EED)
    for i in range(1, len(out)):
        if rng.random() >= share:
            continue
        src = out[rng.randrange(i)].prompt_token_ids
        tokens = out[i].prompt_token_ids
        n = min(len(src) // 2 or len(src), len(tokens))
        tokens[:n] = src[:n]


def given_workload(config: DryRunConfig) -> list[WorkloadRequest]:
    """`config.given_requests` as a workload: random prompt tokens from the seed, except a `prefix` copied from an
    earlier request (so vLLM's prefix cache finds what the recording found)."""
    rng = random.Random(config.seed)
    out: list[WorkloadRequest] = []
    for i, r in enumerate(config.given_requests):
        tokens = [rng.randrange(VOCAB_FOR_PROMPTS) for _ in range(int(r["prompt_len"]))]
        prefix = r.get("prefix")
        if prefix and 0 <= int(prefix[0]) < i:
            shared = out[int(prefix[0])].prompt_token_ids[:min(int(prefix[1]), len(tokens))]
            tokens[:len(shared)] = shared
        eos = r.get("eos")
        out.append(WorkloadRequest(i, int(float(r["arrival_us"]) * 1000), tokens, int(r["max_tokens"]),
                                   None if eos is None else bool(eos), int(r.get("first_step", -1)),
                                   int(r.get("decode_step", -1))))
    out.sort(key=lambda w: (w.arrival_ns, w.index))
    return out

"""`pdtrace chaos`: find vLLM's KV-lifecycle ordering bugs by forcing the orderings nobody tests.

The algorithm (rr's chaos mode and Jepsen applied to the dry run):
1. Draw a trial from the campaign's seed: a small workload (pd: a prefill/decode pair over NIXL, pp: the same at
   PP=2 with its batch queue, single: one engine under KV pressure) and one to four perturbations
   (`pdtrace.dryrun.perturb`: aborts at any moment of a request's life, transfer reports delayed, lost, repeated
   or early, reads slow or failed, a small pool). Each perturbation is labelled legal timing or faulty peer.
2. Run it: the installed vLLM's real EngineCore, Scheduler, KV cache manager and NIXL scheduler side on the
   simulated cluster (`pdtrace.dryrun`), forked from a server that imported vLLM once (`pdtrace.dryrun.zygote`),
   with PYTHONHASHSEED=0, so the same trial gives the same trace.
3. Judge it (`judge`): a failure is vLLM raising (signature: the exception type and the innermost vLLM function
   in its traceback) or, when it did not, an error finding of `pdtrace analyze` (signature: rule/subrule).
4. Minimise the first failure of each signature (`minimise`): delta debugging (Zeller's ddmin) over its
   perturbations, then the workload cut to the requests the remaining perturbations target; every candidate is a
   full run that must fail with the same signature. The minimal trial is run once more into the failure's
   directory with its trace, and `pdtrace chaos --repro DIR` re-runs it.
5. Report per signature, legal timing apart from faulty peer: runs that hit it, time to the first, minimised size.
   A legal-timing failure is a vLLM bug (or a false alarm of pdtrace's own rules: the trace says which).

What it does not do: vary the order of requests inside one step's set iteration (fixed by PYTHONHASHSEED), offload
connectors (none is simulated), steps as a dimension of the minimisation (a perturbation names requests and step
counts; the workload is cut by requests).
"""

from pdtrace.chaos.campaign import (Campaign, CampaignResult, Failure, repro, run_campaign, runnable_workloads,
                                    save_failure)
from pdtrace.chaos.trials import WORKLOADS, Outcome, draw_trial, judge, run_trial

__all__ = ["WORKLOADS", "Campaign", "CampaignResult", "Failure", "Outcome", "draw_trial", "judge", "repro",
           "run_campaign", "run_trial", "runnable_workloads", "save_failure"]

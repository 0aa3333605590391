"""The partitions of `pdtrace.analysis.partitions` as tasks on a Dask cluster (`pdtrace analyze TRACE --dask ADDR`,
`pdtrace.analyze(path, dask=client_or_address)`).

`DaskRunner.connect(target)`: a `distributed.Client` is used as it is (and left open for its owner); an address
(`tcp://dask-scheduler:8786`) gets a client of its own, closed after the analysis. Each partition is one task
(`client.submit(run_partition, task, pure=False)`) and results are taken as they finish, so the cluster's
scheduler decides placement and memory is bounded per worker by the partitions it runs at once. Phase 2's re-runs
of linked groups are tasks too. The workers read the trace where it lives: the path handed to `analyze` must name
the same files on them (a shared filesystem). They need the same pdtrace installed; a task's error (say a
truncated file: TraceError) comes back as that error, so the CLI still prints one line and exits 2.

Dask is the optional extra `pdtrace[dask]`; without it, a UsageError (exit 2) names the extra.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator, Sequence

from pdtrace.analysis.partitions import PartitionResult, PartitionTask, run_partition
from pdtrace.errors import PdtraceError, UsageError

INSTALL_HINT = "--dask needs the optional Dask extra: pip install 'pdtrace[dask]'"

#: Seconds to wait for a scheduler given by address.
CONNECT_TIMEOUT_S = 10


def _distributed() -> Any:
    try:
        import distributed  # optional dependency (pdtrace[dask])
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return distributed


class DaskRunner:
    """Runs tasks on a dask.distributed cluster (see the module docstring)."""

    #: each task runs its rules on one thread: the cluster's worker threads are the parallelism
    threads_per_task = 1
    #: tasks run on other machines: the trace is named by an absolute path (or a URL)
    remote = True

    def __init__(self, client: Any, owned: bool) -> None:
        self.client = client
        self.owned = owned

    @classmethod
    def connect(cls, target: Any) -> "DaskRunner":
        distributed = _distributed()
        if isinstance(target, distributed.Client):
            return cls(target, owned=False)
        if not isinstance(target, str) or not target.strip():
            raise UsageError(f"dask= takes a distributed.Client or a scheduler address, not {target!r}")
        try:
            client = distributed.Client(target.strip(), timeout=CONNECT_TIMEOUT_S, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as exc:
            raise PdtraceError(f"cannot connect to the Dask scheduler at {target}: "
                               f"{' '.join(str(exc).split())[:160]}") from None
        return cls(client, owned=True)

    def run(self, tasks: Sequence[PartitionTask]) -> Iterator[tuple[int, PartitionResult]]:
        distributed = _distributed()
        run_id = uuid.uuid4().hex[:8]
        futures = {self.client.submit(run_partition, task, pure=False, key=f"pdtrace-{run_id}-{i}-{task.name}",
                                      priority=task.rows): i  # the largest partitions first
                   for i, task in enumerate(tasks)}
        try:
            # as_completed's own loop, not the process's default client's: the CLI's client is nobody's default
            for future in distributed.as_completed(list(futures), loop=self.client.loop):
                yield futures[future], future.result()
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        if self.owned:
            self.client.close()

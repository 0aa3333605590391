"""Print the vLLM releases `.ci/run` runs the vLLM tier on, space-separated, in the order to run them.

Usage: python .ci/vllm_matrix.py [--all-versions]

--all-versions: every published release of every hook table (`TableRange.releases`). By default, per table
(pdtrace.recording.vllm._TABLES): its newest tested release (its newest release while none is tested, so that CI
tries the table); the releases of its `splits` (behaviour inside the range the newest release does not show and
the tier tests, e.g. 0.10.1.1's `queue.Queue` batch queue); then, for each behaviour row of
pdtrace.analysis.releases that the table's tested releases fall in and that none of those already covers, the
newest tested release of that row. So every table and every (table, behaviour row) pair the tier has passed on
runs, each once.
"""

from __future__ import annotations

import sys


def default_matrix() -> list[str]:
    """The default .ci/run matrix (see the module's docstring)."""
    from pdtrace.analysis.releases import behaviour_of
    from pdtrace.recording.vllm import _TABLES

    out: list[str] = []
    for entry in _TABLES:
        tested = entry.tested or entry.releases[-1:]  # a table the tier never passed on: its newest release
        picked = [tested[-1], *entry.splits]
        covered = {behaviour_of(v) for v in picked}
        for version in reversed(tested):
            if behaviour_of(version) not in covered:
                picked.append(version)
                covered.add(behaviour_of(version))
        out += [v for v in picked if v not in out]
    return out


def all_versions() -> list[str]:
    """Every published release of every hook table, oldest first."""
    from pdtrace.recording.vllm import _TABLES

    return [v for entry in _TABLES for v in entry.releases]


def main(argv: list[str]) -> int:
    if argv not in ([], ["--all-versions"]):
        print("usage: vllm_matrix.py [--all-versions]", file=sys.stderr)
        return 2
    print(" ".join(all_versions() if argv else default_matrix()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

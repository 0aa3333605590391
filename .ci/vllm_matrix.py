"""Print the vLLM releases `.ci/run` runs the vLLM tier on, space-separated, in the order to run them.

Usage: python .ci/vllm_matrix.py [--behaviours | --all-versions]

By default, one release per hook table (pdtrace.recording.vllm._TABLES): its newest tested release (its newest
release while none is tested, so that CI tries the table). That keeps `.ci/run` inside CI's budget: a release's
tier costs 2-5 minutes, most of it its dry runs, each a fresh process importing that release's vLLM (6-13 s).

--behaviours: also, per table, the releases of its `splits` (behaviour inside the range the newest release does
not show and the tier tests, e.g. 0.10.1.1's `queue.Queue` batch queue), then, for each behaviour row of
pdtrace.analysis.releases that the table's tested releases fall in and that none of those already covers, the
newest tested release of that row: every table and every (table, behaviour row) pair the tier has passed on, each
once.

--all-versions: every published release of every hook table (`TableRange.releases`).
"""

from __future__ import annotations

import sys


def default_matrix() -> list[str]:
    """One release per hook table: its newest tested release, else its newest release."""
    from pdtrace.recording.vllm import _TABLES

    return [(entry.tested or entry.releases)[-1] for entry in _TABLES]


def behaviour_matrix() -> list[str]:
    """Every table and every (table, behaviour row) pair the tier has passed on (see the module's docstring)."""
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
    choices = {(): default_matrix, ("--behaviours",): behaviour_matrix, ("--all-versions",): all_versions}
    if tuple(argv) not in choices:
        print("usage: vllm_matrix.py [--behaviours | --all-versions]", file=sys.stderr)
        return 2
    print(" ".join(choices[tuple(argv)]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

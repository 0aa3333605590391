"""pdtrace.malloc: the CLI's process and the partition workers allocate from one glibc arena (see its docstring)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Four threads alive at once each allocate: the count of those allocations below the program break (the main
#: arena's heap; other arenas are mmapped far above it).
THREADS_IN_MAIN_ARENA = r"""
import ctypes, sys, threading
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
addresses, barrier = [], threading.Barrier(4)
def allocate():
    barrier.wait()
    addresses.append(libc.malloc(200))
threads = [threading.Thread(target=allocate) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sum(a < libc.sbrk(0) for a in addresses))
"""


def _in_main_arena(setup: str) -> int:
    done = subprocess.run([sys.executable, "-c", THREADS_IN_MAIN_ARENA.format(setup=setup)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_the_cli_takes_one_arena_before_numpy_and_pyarrow_start_threads() -> None:
    if _in_main_arena("import numpy, pyarrow.dataset") == 4:
        pytest.skip("this libc gives every thread the main arena anyway")
    # the CLI module alone: every later thread (the rules') allocates from the main arena
    assert _in_main_arena("import pdtrace.cli") == 4
    # as main() did before: numpy's and pyarrow's threads had arenas already, which later threads got in turn
    late = "import numpy, pyarrow.dataset\nfrom pdtrace.malloc import single_arena\nsingle_arena()"
    assert _in_main_arena(late) < 4


def test_the_workers_initializer_imports_neither_numpy_nor_pyarrow() -> None:
    # a partition worker unpickles its initializer (importing its module) before running it: pdtrace.malloc must
    # stay standard-library only for the arena to be set before numpy's and pyarrow's threads start
    done = subprocess.run([sys.executable, "-c", "import sys, pdtrace.malloc\n"
                           "print(sorted(m for m in ('numpy', 'pyarrow', 'pandas') if m in sys.modules))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]

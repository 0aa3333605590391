"""Cost of the vLLM hook wrappers around a call while recording is off (the pass-through): ns per call.

    PYTHONPATH=ROOT .venv/bin/python bench/hook_passthrough.py [--table v0_33] [--calls 200000] [--rounds 7]

For every hook of the release's table whose wrapper builds without vLLM, the wrapper is built around a do-nothing
method with the hook's parameters and called `--calls` times with RUNTIME.active False; the same loop calling
the bare method is subtracted. Reported: the median over the hooks of the added ns per call (thread CPU time, the
best of `--rounds`), and each hook's. Run it on two checkouts (PYTHONPATH) to compare a change.

With `--active`, also the guard's own cost with recording on: the hooks' hand-written shape (the work inline)
against `_runtime.guarded` with a `before` and an `after` that do nothing (two more Python calls).
"""

from __future__ import annotations

import argparse
import statistics
import time


def _method(params: tuple[str, ...]):
    names = ", ".join(("self",) + params)
    scope: dict = {}
    exec(f"def method({names}):\n    return None\n", scope)  # noqa: S102 - a method of the hook's arity
    return scope["method"]


def _per_call(fn, args: tuple, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        for _ in range(calls):
            fn(*args)
        best = min(best, time.thread_time_ns() - t0)
    return best / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="v0_33", help="the table's module (v0_33, v0_11, ...)")
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--active", action="store_true")
    a = ap.parse_args()
    import importlib

    from pdtrace.recording.vllm._runtime import RUNTIME

    RUNTIME.active = False
    table = importlib.import_module(f"pdtrace.recording.vllm.{a.table}").TABLE
    added = {}
    for hook in table:
        orig = _method(hook.params)
        try:
            wrapper = hook.factory(orig)
        except Exception:  # noqa: BLE001 - a factory that needs vLLM itself is left out
            continue
        args = (object(),) + (None,) * len(hook.params)
        try:
            wrapper(*args)
        except Exception:  # noqa: BLE001 - a wrapper that reads vLLM objects even when off is left out
            continue
        bare = _per_call(orig, args, a.calls, a.rounds)
        added[f"{hook.owner}.{hook.name}"] = _per_call(wrapper, args, a.calls, a.rounds) - bare
    for name, ns in sorted(added.items()):
        print(f"{name:55s} {ns:7.1f} ns")
    print(f"hooks: {len(added)}  median added: {statistics.median(added.values()):.1f} ns/call  "
          f"total: {sum(added.values()):.1f} ns")
    if a.active:
        _active(a.calls, a.rounds)


def _active(calls: int, rounds: int) -> None:
    from pdtrace.recording.vllm import _runtime

    rt = _runtime.RUNTIME

    def orig(self, request):
        return None

    def before(self, request):
        return 1

    def after(ctx, self, out, request):
        return None

    def inline(self, request):  # the work written in the wrapper itself, as the hooks had it
        if not rt.active:
            return orig(self, request)
        try:
            ctx = 1
        except Exception as exc:
            rt.fail("x", exc)
            return orig(self, request)
        out = orig(self, request)
        if rt.active:
            try:
                ctx = None
            except Exception as exc:
                rt.fail("x", exc)
        return out

    rt.active = True
    try:
        bare = _per_call(orig, (None, None), calls, rounds)
        print(f"active, work inline in the wrapper: {_per_call(inline, (None, None), calls, rounds) - bare:.1f} ns/call")
        if hasattr(_runtime, "guarded"):
            made = _per_call(_runtime.guarded("x", ("request",), before, after)(orig), (None, None), calls,
                             rounds) - bare
            print(f"active, guarded with a before and an after doing nothing: {made:.1f} ns/call")
    finally:
        rt.active = False


if __name__ == "__main__":
    main()

"""`_runtime.guarded`, the one guard of every vLLM hook wrapper: recording off -> vLLM's call alone; pdtrace's own
error -> counted, recording switched off, vLLM's call still made and its answer returned; vLLM's error -> raised
as it is; state set by `before` undone whether vLLM's call returned or raised."""

from __future__ import annotations

import pytest

from pdtrace.recording.vllm import _runtime
from pdtrace.recording.vllm._runtime import RUNTIME, SKIP, guarded


@pytest.fixture()
def rt(monkeypatch):
    monkeypatch.setattr(RUNTIME, "active", True)
    monkeypatch.setattr(_runtime.session, "recording_off_all", lambda why: None)
    RUNTIME.reset()
    yield RUNTIME
    RUNTIME.reset()


def test_off_calls_the_original_alone(rt):
    seen = []
    wrapped = guarded("m", ("a",), lambda self, a: seen.append("before"), lambda *x: seen.append("after"))(
        lambda self, a: a * 2)
    rt.active = False
    assert wrapped(None, 21) == 42 and seen == []
    rt.active = True
    assert wrapped(None, 21) == 42 and seen == ["before", "after"]


def test_before_after_restore_see_the_call(rt):
    log = []

    def before(self, a, b):
        log.append(("before", a, b))
        return "ctx"

    def after(ctx, self, out, a, b):
        log.append(("after", ctx, out, a, b))

    wrapped = guarded("m", ("a", "b"), before, after, restore=lambda ctx: log.append(("restore", ctx)))(
        lambda self, a, b: a + b)
    assert wrapped("self", 1, b=2) == 3
    assert log == [("before", 1, 2), ("restore", "ctx"), ("after", "ctx", 3, 1, 2)]
    assert wrapped.__name__ == "<lambda>"


def test_an_own_error_is_counted_switches_off_and_vllm_goes_on(rt):
    def broken(*args):
        raise KeyError("ours")

    calls = []
    wrapped = guarded("m", ("a",), before=broken)(lambda self, a: calls.append(a) or "vllm")
    assert wrapped(None, 1) == "vllm" and calls == [1]
    assert rt.errors == 1 and rt.active is False and "m: KeyError" in rt.first_error
    rt.active = True
    wrapped = guarded("n", None, after=broken)(lambda self, *a, **k: "vllm")
    assert wrapped(None, 1, x=2) == "vllm" and rt.errors == 2 and rt.active is False


def test_vllm_errors_pass_through_and_restore_still_runs(rt):
    restored = []

    def vllm(self, a):
        raise ValueError("vLLM's own")

    wrapped = guarded("m", ("a",), lambda self, a: "set", restore=restored.append)(vllm)
    with pytest.raises(ValueError, match="vLLM's own"):
        wrapped(None, 1)
    assert restored == ["set"] and rt.errors == 0 and rt.active is True


def test_skip_leaves_the_call_to_vllm(rt):
    after, restored = [], []
    wrapped = guarded("m", ("a",), lambda self, a: SKIP, lambda *x: after.append(x), restored.append)(
        lambda self, a: a)
    assert wrapped(None, 5) == 5 and after == [] and restored == []


def test_restore_without_before_is_refused():
    with pytest.raises(ValueError):
        guarded("m", (), restore=lambda ctx: None)

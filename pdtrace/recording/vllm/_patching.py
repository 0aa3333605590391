"""Applying one version's hook table: checked class-method wrapping, reversible, with lazy modules.

A table entry names a class attribute by module, class and method, lists the parameter names pdtrace relies on,
and gives the factory that builds the wrapper from the original function. Nothing is guessed: before anything is
wrapped, every entry of a module is checked (the class and method exist, the parameters start with the listed
names); a mismatch wraps nothing of the table and reports which name did not match.

Worker-side modules (`lazy=True`) are not imported by pdtrace: importing a GPU model runner into the API server
would cost seconds for nothing. They are wrapped when the process imports them (a `sys.meta_path` finder that
runs after the module's own code), or at once if already imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: Attribute set on each wrapper: the original function it wraps (also how an already-wrapped method is spotted).
ORIGINAL_ATTR = "__pdtrace_original__"


@dataclass(frozen=True)
class Hook:
    """One wrapped method: `module.owner.name`, built by `factory(original) -> wrapper`."""

    module: str
    owner: str
    name: str
    factory: Callable[[Callable[..., Any]], Callable[..., Any]]
    params: tuple[str, ...] = ()
    lazy: bool = False


class TableMismatch(Exception):
    """The installed vLLM does not have a name or parameter the table expects."""


def _lookup(module: ModuleType, hook: Hook) -> tuple[type, Callable[..., Any]]:
    owner = getattr(module, hook.owner, None)
    if not isinstance(owner, type):
        raise TableMismatch(f"{hook.module}.{hook.owner} is missing")
    func = owner.__dict__.get(hook.name)
    if func is None:
        raise TableMismatch(f"{hook.module}.{hook.owner}.{hook.name} is missing")
    original = getattr(func, ORIGINAL_ATTR, func)
    if hook.params:
        try:
            names = tuple(inspect.signature(original).parameters)[1:]  # drop self
        except (TypeError, ValueError) as exc:
            raise TableMismatch(f"{hook.owner}.{hook.name}: no signature ({exc})") from None
        if names[: len(hook.params)] != hook.params:
            raise TableMismatch(f"{hook.owner}.{hook.name}{tuple(names)} does not start with {hook.params}")
    return owner, original


class Patcher:
    """Applies and reverts the hooks of one table; thread-safe, idempotent."""

    def __init__(self, hooks: Sequence[Hook], on_lazy_mismatch: Callable[[str], None]) -> None:
        self._hooks = tuple(hooks)
        self._applied: list[tuple[type, str, Callable[..., Any]]] = []
        self._pending: dict[str, list[Hook]] = {}
        self._finder: _PostImportFinder | None = None
        self._lock = threading.RLock()
        self._on_lazy_mismatch = on_lazy_mismatch

    def apply(self) -> None:
        """Wrap every eager hook (importing its module) and arrange the lazy ones; raises TableMismatch."""
        with self._lock:
            by_module: dict[str, list[Hook]] = {}
            for hook in self._hooks:
                by_module.setdefault(hook.module, []).append(hook)
            eager = {m: hs for m, hs in by_module.items() if not all(h.lazy for h in hs)}
            lazy = {m: hs for m, hs in by_module.items() if all(h.lazy for h in hs)}
            resolved: list[tuple[Hook, type, Callable[..., Any]]] = []
            for module_name, hooks in eager.items():
                module = importlib.import_module(module_name)
                resolved.extend((h, *_lookup(module, h)) for h in hooks)
            for hook, owner, original in resolved:  # all checked: now wrap
                self._wrap(hook, owner, original)
            for module_name, hooks in lazy.items():
                module = sys.modules.get(module_name)
                if module is not None:
                    self._apply_module(module, hooks)
                else:
                    self._pending[module_name] = hooks
            if self._pending:
                self._finder = _PostImportFinder(self)
                sys.meta_path.insert(0, self._finder)

    def _wrap(self, hook: Hook, owner: type, original: Callable[..., Any]) -> None:
        wrapper = hook.factory(original)
        setattr(wrapper, ORIGINAL_ATTR, original)
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(wrapper, attr, getattr(original, attr))
            except (AttributeError, TypeError):
                pass
        self._applied.append((owner, hook.name, owner.__dict__[hook.name]))
        setattr(owner, hook.name, wrapper)

    def _apply_module(self, module: ModuleType, hooks: list[Hook]) -> None:
        try:
            resolved = [(h, *_lookup(module, h)) for h in hooks]
        except TableMismatch as exc:
            self._on_lazy_mismatch(str(exc))
            return
        for hook, owner, original in resolved:
            self._wrap(hook, owner, original)

    def module_imported(self, module: ModuleType) -> None:
        """Called by the finder right after a pending module's own code ran."""
        with self._lock:
            hooks = self._pending.pop(module.__name__, None)
            if hooks:
                self._apply_module(module, hooks)

    def pending_modules(self) -> frozenset[str]:
        """Lazy modules not imported yet."""
        return frozenset(self._pending)

    def revert(self) -> None:
        """Put every original back and stop watching imports."""
        with self._lock:
            for owner, name, previous in reversed(self._applied):
                setattr(owner, name, previous)
            self._applied.clear()
            self._pending.clear()
            if self._finder is not None:
                try:
                    sys.meta_path.remove(self._finder)
                except ValueError:
                    pass
                self._finder = None


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for a pending module it wraps the real loader so that the hooks apply after exec."""

    def __init__(self, patcher: Patcher) -> None:
        self._patcher = patcher
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self._patcher.pending_modules() or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostImportLoader(spec.loader, self._patcher)
        return spec


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patcher: Patcher) -> None:
        self._loader = loader
        self._patcher = patcher

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            self._patcher.module_imported(module)
        except Exception:  # never break vLLM's import
            logging.getLogger("pdtrace").warning("pdtrace: could not hook %s", module.__name__, exc_info=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def overlay(base: Sequence[Hook], *, replace: Sequence[Hook] = (), drop: Sequence[str] = ()) -> tuple[Hook, ...]:
    """An older release's table as a thin overlay of a newer one: `base` without the hooks named `Owner.name` in
    `drop`, each hook of `replace` in the place of base's hook of the same owner and name (appended if none)."""
    unknown = set(drop) - {f"{h.owner}.{h.name}" for h in base}
    if unknown:
        raise ValueError(f"overlay: nothing to drop named {sorted(unknown)}")
    by_name = {f"{h.owner}.{h.name}": h for h in replace}
    out = [by_name.pop(f"{h.owner}.{h.name}", h) for h in base if f"{h.owner}.{h.name}" not in drop]
    return tuple(out) + tuple(by_name.values())


#: A parameter without a default, in `takes_exactly`'s `params`.
REQUIRED = inspect.Parameter.empty


def takes_exactly(func: Callable[..., Any], params: Sequence[tuple[str, Any]]) -> bool:
    """Whether `func` (a function taking self first, or a bound method) takes exactly `params` after self: (name,
    default or REQUIRED) pairs, each positional-or-keyword. A wrapper factory then builds a wrapper with that very
    signature, and the general `*args, **kwargs` one otherwise (another release): the named one passes a call
    through for 57 ns instead of 280 (49 / 180 ns without the keyword argument; the bare method: 34 / 26 ns;
    timeit, a three-parameter method on a vLLM KVCacheBlock called as allocate_slots calls remove_skipped_blocks).
    Python 3.11 builds an args tuple and a kwargs dict per call of a `*args, **kwargs` function, and again for the
    call it forwards (CALL_FUNCTION_EX)."""
    try:
        found = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False
    if not inspect.ismethod(func):
        found = found[1:]
    return len(found) == len(params) and all(
        p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name == name and p.default is default
        for p, (name, default) in zip(found, params))

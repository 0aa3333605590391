"""pdtrace.dryrun.compat without vLLM: where each release keeps NIXL's RemoteMeta decides whether P and D share a
request id (fake modules stand in for the releases' layouts)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from pdtrace.dryrun import compat

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


def _layout(monkeypatch: pytest.MonkeyPatch, module: str | None, request_id: bool = True) -> None:
    """No NIXL module importable but `module` (under kv_connector.v1), holding a RemoteMeta with or without a
    `request_id` field (None: a module without RemoteMeta, as 0.10 to 0.12's nixl_connector.py)."""
    for name in compat._NIXL_METADATA_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: ImportError on import
    if module is None:
        monkeypatch.setitem(sys.modules, f"{_V1}.nixl_connector", types.ModuleType("nixl_connector"))
        return
    fields = [("block_ids", list), ("engine_id", str)] + [("request_id", str)] * request_id
    fake = types.ModuleType(module)
    fake.RemoteMeta = dataclasses.make_dataclass("RemoteMeta", fields)
    monkeypatch.setitem(sys.modules, f"{_V1}.{module}", fake)


@pytest.mark.parametrize("module, request_id, shared", [
    (None, False, True),                  # 0.10 to 0.12: nixl_connector.py without RemoteMeta
    ("nixl_connector", True, False),      # 0.13 to 0.17 (and on): RemoteMeta in nixl_connector.py
    ("nixl.metadata", True, False),       # 0.28+: nixl/metadata.py
    ("nixl.connector", True, False),      # a package without a metadata module
    ("nixl.metadata", False, True),       # a RemoteMeta that names no remote request
])
def test_shared_request_ids_follows_remote_meta_wherever_the_release_keeps_it(monkeypatch, module, request_id,
                                                                              shared):
    _layout(monkeypatch, module, request_id)
    assert compat.shared_request_ids() is shared

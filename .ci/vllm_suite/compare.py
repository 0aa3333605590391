"""Compare vLLM's own tests run plain and under `pytest -p pdtrace`: outcomes must match, traces must be clean.

Usage: python compare.py PLAIN.xml PDTRACE.xml PDTRACE_DIR/summary.json ALLOWLIST

Reads both runs' JUnit XML and the plugin's summary.json (one record per recorded test). Prints, per test file:
tests, passed / failed / skipped without and with the plugin, traces with events, tests with error findings;
then every test whose outcome changed, every test with an error finding (rule/subrule), and every test whose
hooks switched themselves off (a test double in vLLM's way). Exit status 1 when an outcome changed, or when a test
has an error finding that the allowlist does not name, or when an allowlisted true positive is no longer found; and
when the witness saw nothing: the plugin recorded no test (an empty or missing summary), a test file none of whose
tests recorded an event (each file was chosen because its tests drive the Scheduler, where the hooks record), or a
test whose hooks switched themselves off that the allowlist does not name as `hooks-off`.

The allowlist (checked in beside this script) has one line per test: `KIND | NODEID | REASON`, KIND being
`true-positive` (a test that deliberately injects a fault pdtrace should see), `temporary` (a known false alarm
being fixed elsewhere; a temporary entry whose finding is gone is reported, not failed) or `hooks-off` (a test whose
test double makes a hook fail, so recording switches itself off for it; one that no longer does is reported, not
failed). `#` starts a comment.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

KINDS = ("true-positive", "temporary", "hooks-off")


def junit_key(nodeid: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit XML gives a test id: `a/b.py::C::t[x]` -> ("a.b.C", "t[x]")."""
    path, *names = nodeid.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", "."), *names[:-1]]), names[-1] if names else ""


def outcomes(xml_path: Path) -> dict[tuple[str, str], str]:
    """(classname, name) -> passed | failed | error | skipped, from a JUnit XML file."""
    out: dict[tuple[str, str], str] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("failed" if "failure" in tags else "error" if "error" in tags
                   else "skipped" if "skipped" in tags else "passed")
        out[(case.get("classname", ""), case.get("name", ""))] = outcome
    return out


def file_of(key: tuple[str, str]) -> str:
    """The test file of a JUnit key (test classes start with an upper-case letter)."""
    parts = key[0].split(".")
    while parts and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py" if parts else key[1]


def read_allowlist(path: Path) -> dict[str, tuple[str, str]]:
    """nodeid -> (kind, reason)."""
    entries: dict[str, tuple[str, str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip() if line.lstrip().startswith("#") else line.strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split("|", 2)]
        if len(fields) != 3 or fields[0] not in KINDS or not fields[2]:
            sys.exit(f"{path}:{number}: expected 'KIND | NODEID | REASON' with KIND one of {', '.join(KINDS)}")
        entries[fields[1]] = (fields[0], fields[2])
    return entries


def main(plain_xml: Path, pdtrace_xml: Path, summary_json: Path, allowlist_path: Path) -> int:
    plain, traced = outcomes(plain_xml), outcomes(pdtrace_xml)
    summary = json.loads(summary_json.read_text()) if summary_json.is_file() else []
    records = {junit_key(r["nodeid"]): r for r in summary}
    allow = read_allowlist(allowlist_path)
    allow_keys = {junit_key(nodeid): (nodeid, kind, reason) for nodeid, (kind, reason) in allow.items()
                  if kind != "hooks-off"}
    hooks_off_allowed = {junit_key(nodeid): (nodeid, reason) for nodeid, (kind, reason) in allow.items()
                         if kind == "hooks-off"}

    per_file: dict[str, Counter] = defaultdict(Counter)
    changed, errors, unexplained, switched_off = [], [], [], []
    for key in sorted(set(plain) | set(traced)):
        f = per_file[file_of(key)]
        a, b = plain.get(key, "missing"), traced.get(key, "missing")
        f["tests"] += 1
        f[f"plain_{a}"] += 1
        f[f"pdtrace_{b}"] += 1
        if a != b:
            changed.append((key, a, b))
        rec = records.get(key)
        if rec is None:
            continue
        f["events"] += bool(rec["events"])
        if rec["hook_errors"]:
            switched_off.append((key, rec["first_hook_error"]))
        if rec["findings"].get("error"):
            f["errors"] += 1
            rules = sorted(set(rec["failing"]) | set(rec["allowed"]))
            entry = allow_keys.get(key)
            errors.append((key, rules, entry))
            if entry is None:
                unexplained.append(key)

    def col(c: Counter, run: str) -> str:
        return f"{c[run + '_passed']}/{c[run + '_failed'] + c[run + '_error']}/{c[run + '_skipped']}"

    width = max(len(name) for name in per_file) if per_file else 10
    print(f"{'file':<{width}}  tests  plain p/f/s  pdtrace p/f/s  traces with events  error findings")
    total: Counter = Counter()
    for name in sorted(per_file):
        c = per_file[name]
        total.update(c)
        print(f"{name:<{width}}  {c['tests']:>5}  {col(c, 'plain'):>11}  {col(c, 'pdtrace'):>13}  "
              f"{c['events']:>18}  {c['errors']:>14}")
    print(f"{'total':<{width}}  {total['tests']:>5}  {col(total, 'plain'):>11}  {col(total, 'pdtrace'):>13}  "
          f"{total['events']:>18}  {total['errors']:>14}")
    print(f"\noutcomes equal: {total['tests'] - len(changed)} of {total['tests']}")
    for key, a, b in changed:
        print(f"  CHANGED {'::'.join(key)}: {a} without pdtrace, {b} with it")

    def nodeid(key: tuple[str, str]) -> str:
        rec = records.get(key)
        return rec["nodeid"] if rec else "::".join(key)

    print(f"tests with error findings: {len(errors)}")
    for key, rules, entry in errors:
        label = f"{entry[1]}: {entry[2]}" if entry else "NOT IN THE ALLOWLIST"
        print(f"  {nodeid(key)}: {', '.join(rules)} ({label})")
    lost = []
    found = {key for key, _, _ in errors}
    for key, (name, kind, _) in allow_keys.items():
        if key not in found:
            print(f"  allowlisted ({kind}) but without an error finding now: {name}")
            if kind == "true-positive":
                lost.append(name)
    print(f"tests whose hooks switched themselves off: {len(switched_off)}")
    hooks_off = []
    for key, why in switched_off:
        entry = hooks_off_allowed.get(key)
        print(f"  {nodeid(key)}: {why} ({'hooks-off: ' + entry[1] if entry else 'NOT IN THE ALLOWLIST'})")
        if entry is None:
            hooks_off.append(key)
    off = {key for key, _ in switched_off}
    for key, (name, _) in hooks_off_allowed.items():
        if key not in off:
            print(f"  allowlisted (hooks-off) but recorded without a hook error now: {name}")
    # the witness saw nothing: no test recorded, or a file none of whose tests recorded an event
    silent = sorted(name for name, c in per_file.items() if c["tests"] and not c["events"])
    print(f"test files whose tests recorded no event: {len(silent)}" + (" (no test recorded at all)"
                                                                         if not records else ""))
    for name in silent:
        print(f"  {name}")
    nothing = not records or not total["events"]
    failed = bool(changed or unexplained or lost or hooks_off or silent or nothing)
    print("\nvllm-suite: " + ("FAILED" if failed else "ok") + f" ({len(changed)} outcomes changed, "
          f"{len(unexplained)} unexplained error findings, {len(lost)} true positives lost, "
          f"{len(hooks_off)} tests whose hooks switched off unexplained, {len(silent)} files recorded nothing"
          + (", nothing recorded" if nothing else "") + ")")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: compare.py PLAIN.xml PDTRACE.xml SUMMARY.json ALLOWLIST")
    sys.exit(main(*(Path(a) for a in sys.argv[1:])))

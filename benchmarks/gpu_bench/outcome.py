"""After each phase, scripts/gpu_bench.sh runs this: it settles the phase's JSON by the exit
status (124 or 137: ``timeout``; another non-zero: ``failed``; a phase that exited 0 without
finishing its record: ``failed``), keeps every row the phase wrote, puts the end of its log
into ``error`` when it did not succeed (or writes the whole record, when the phase died
before writing one), and prints the phase's progress line. It never fails the script.

    python -m benchmarks.gpu_bench.outcome OUT/PHASE.json --rc RC --seconds S --log OUT/PHASE.log
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMEOUT_RCS = (124, 137)
LOG_LINES = 25


def settle(doc: dict | None, phase: str, rc: int, seconds: float, log_tail: str) -> dict:
    """The phase's final record from what it wrote (None: nothing readable) and how it ended."""
    doc = dict(doc) if doc else {"phase": phase, "status": "running", "rows": [], "error": None}
    if rc in TIMEOUT_RCS:
        doc["status"] = "timeout"
    elif rc != 0 or doc.get("status") != "ok":
        doc["status"] = "failed"
    if doc["status"] != "ok":
        ended = f"timed out (exit {rc})" if rc in TIMEOUT_RCS else f"exit {rc}"
        doc["error"] = "; ".join(filter(None, [doc.get("error"), ended])) + "\n" + log_tail
    doc["exit_status"] = rc
    doc["wall_seconds"] = seconds
    return doc


def progress_line(doc: dict, index: str) -> str:
    rows = doc.get("rows", [])
    measured = sum(1 for r in rows if "skipped" not in r)
    return (f"== phase {index} {doc['phase']}: {doc['status']} in {doc['wall_seconds']:g} s, "
            f"{measured} measured, {len(rows) - measured} skipped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--rc", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument("--index", default="", help="the phase's place, as 2/4")
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.json.read_text())
    except (OSError, ValueError):
        doc = None
    try:
        tail = "\n".join(args.log.read_text(errors="replace").splitlines()[-LOG_LINES:])
    except OSError:
        tail = ""
    doc = settle(doc, args.json.stem, args.rc, args.seconds, tail)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(progress_line(doc, args.index), flush=True)
    if doc["status"] != "ok":
        print(doc["error"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Processes seen through /proc."""

import os
from pathlib import Path


def session_pids(sid: int) -> dict[int, str]:
    """Live processes of session ``sid`` (``pdserve serve`` ran in a session of its own)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
        except (OSError, IndexError, ValueError):
            continue
    return found

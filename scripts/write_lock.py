"""Print a constraints file of every package installed in a virtualenv (for `make lock`).

The project itself is left out, and torch is written without its local tag (``+cpu``) so that
a CUDA build of the same version satisfies the pin on a GPU host.
"""

from __future__ import annotations

import subprocess
import sys

HEADER = """\
# Every package that 'make test' and 'make serve' install, with its exact version.
# Refresh with 'make lock' (a fresh venv from pyproject.toml, then pip freeze).
# torch is pinned without a local tag so a CUDA build of 2.13.0 satisfies it on GPU hosts."""


def main(venv: str) -> None:
    frozen = subprocess.run([f"{venv}/bin/python", "-m", "pip", "freeze", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout.splitlines()
    lines = []
    for line in frozen:
        if not line or line.startswith("#") or line.startswith("-e") or line.startswith("pdserve"):
            continue
        name, _, version = line.partition("==")
        lines.append(f"{name}=={version.split('+')[0]}")
    print(HEADER)
    print("\n".join(sorted(lines, key=str.lower)))


if __name__ == "__main__":
    main(sys.argv[1])

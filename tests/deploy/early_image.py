"""The CPU image built in the background from the start of a session that will run
tests/deploy/test_image.py, instead of inside that test's fixture.

On a machine that has never built it, the build takes three to four minutes (Debian's packages
fetched and unpacked by mmdebstrap, the locked wheels fetched, then `podman build`), much of it
waiting on the network and the disk; the suite is waiting on processes starting for much of its
own time too, so the two overlap. The image fixture then waits for this build and calls
deploy/image.py's build itself, which reuses what was built, or, if the background build failed,
builds again in the foreground and fails there with the build's own error. On a machine where the
image is up to date the background step finds that at once and exits.

``PDSERVE_IMAGE_EARLY=0`` turns it off (the build then happens in the fixture, as before).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = "tests/deploy/test_image.py"

_build: subprocess.Popen | None = None
_log: Path | None = None


def start(nodeids: list[str]) -> None:
    """Start the build if the session will run the image tests and podman is here."""
    global _build, _log
    if _build is not None or os.environ.get("PDSERVE_IMAGE_EARLY") == "0" or shutil.which("podman") is None:
        return
    if not any(n.startswith(TEST_FILE) for n in nodeids):
        return
    fd, name = tempfile.mkstemp(prefix="pdserve-image-build-", suffix=".log")
    _log = Path(name)
    with os.fdopen(fd, "w") as out:
        # nice 10: the tests that run meanwhile keep the cores first; the build takes what they leave.
        _build = subprocess.Popen(["nice", "-n", "10", sys.executable, str(ROOT / "deploy" / "image.py")],
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, cwd=ROOT)


def wait() -> None:
    """Wait for the background build, if one was started (its errors show again in the fixture's
    own build, which runs after it)."""
    if _build is not None:
        _build.wait()


def stop() -> None:
    """End a build still running when the session ends (a run cut short before the image tests)."""
    if _build is not None and _build.poll() is None:
        os.killpg(_build.pid, signal.SIGTERM)
        try:
            _build.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(_build.pid, signal.SIGKILL)
    if _log is not None:
        _log.unlink(missing_ok=True)

"""The stop deadline holds when its own timer thread cannot run: a main thread that keeps the
GIL inside one C call (a catastrophic regex here; a Ray call blocked on a lost GCS in the
field) starves ``StopDeadline``'s Python timer, and the C watchdog under it still ends the
process, with every thread's stack on stderr. And ``kill -USR1`` dumps the stacks without
stopping anything."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

HOLDS_THE_GIL = """
import re, sys
from pdserve.cluster import shutdown
shutdown.StopDeadline(0.5).start()
print("armed", flush=True)
re.match(r"(a+)+$", "a" * 64 + "b")  # one C call, exponential: it never lets the GIL go
print("the regex returned", flush=True)
"""


def test_the_watchdog_ends_a_stop_whose_timer_thread_is_starved():
    proc = subprocess.run([sys.executable, "-c", HOLDS_THE_GIL], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.strip() == "armed", proc.stdout
    # The Python timer never ran (it prints before ending anything); the watchdog did, and
    # says where the main thread was.
    assert "did not finish" not in proc.stdout + proc.stderr
    assert "Timeout (0:00:02)!" in proc.stderr, proc.stderr
    assert 'File "<string>", line 6 in <module>' in proc.stderr, proc.stderr


WAITS = """
import threading
from pdserve.cluster import shutdown
shutdown.dump_stacks_on()
print("ready", flush=True)
threading.Event().wait(60)
"""


def test_sigusr1_dumps_every_stack_and_the_process_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", WAITS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)  # the dump is written from the signal handler, at once
        assert proc.poll() is None, "SIGUSR1 must not stop the process"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    # (The line may be the print's or the wait's: the signal can come between the two.)
    assert "Current thread" in err and 'File "<string>", line ' in err, err

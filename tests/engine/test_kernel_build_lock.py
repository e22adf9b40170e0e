"""A kernel compile that was killed must not make every later start wait on its lock."""

import os
import time

from pdserve.engine.kernels import cpu_kernels


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    cpu_kernels._clear_stale_build_lock(tmp_path)
    assert lock.exists()  # a compile may be running now: wait for it
    old = time.time() - cpu_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_kernels._clear_stale_build_lock(tmp_path)
    assert not lock.exists()
    cpu_kernels._clear_stale_build_lock(tmp_path)  # no lock: nothing to do

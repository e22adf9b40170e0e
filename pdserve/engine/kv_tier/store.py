"""The KV tier's files: one per block, in a directory the processes of a host share.

Layout: ``<offload_dir>/<namespace>/<chained hash hex>.kvb``. The namespace is a fingerprint of
everything that decides what a block's bytes mean (``engine_tier.py``), so only engines of one
model, dtype and cache layout ever open the same files. A file is::

    header  (28 bytes, little-endian): magic b"PDKV", version, hash length, token count,
            payload bytes, xxh3_64 of everything after the header
    hash    the block's chained hash (16 bytes)
    tokens  its token ids, int64 each
    payload the block's row of the KV cache, as bytes

Writers write a temporary name and rename it: a reader sees a whole file or none. Readers take
no lock; a file unlinked while one reads it stays readable through the open descriptor (POSIX),
and one unlinked before it is opened is a miss. A file whose header, hash, tokens or checksum
does not match is deleted and reported corrupt: the caller computes the block instead.

The directory is bounded by ``capacity_bytes`` over all its processes. A lock file
(``.lock``, ``flock``) serializes the changes of the set of files and holds their total size in
its first 8 bytes; a writer that would pass the bound scans the directory and unlinks the least
recently used files (oldest ``mtime``: a load touches its file) down to 90% of it, so that scans
are rare. A process that dies between its rename and its count leaves the total low by one file
until the next scan, which recounts.
"""

from __future__ import annotations

import enum
import fcntl
import os
import struct
import threading
import time
from typing import Sequence

import numpy as np
import xxhash

MAGIC = b"PDKV"
VERSION = 1
HEADER = struct.Struct("<4sHHIQQ")  # magic, version, hash length, token count, payload bytes, xxh3_64
SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 60.0  # a temporary file this old belongs to a writer that died: removed at a scan
LOW_WATER = 0.9  # an eviction frees the directory down to this share of its bound


class ReadResult(enum.Enum):
    HIT = "hit"  # the payload was read into the caller's buffer and verified
    MISS = "miss"  # no such file (never stored, evicted, or removed while we looked)
    CORRUPT = "corrupt"  # the file did not match (deleted)


class BlockStore:
    """The files of one namespace directory (module docstring). Thread-safe."""

    def __init__(self, directory: str, capacity_bytes: int, payload_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"kv_offload_bytes must be at least 1, got {capacity_bytes}")
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = payload_bytes
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock_fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        self._mutex = threading.Lock()  # flock is per open file: threads of this process take this too

    def file_bytes(self, num_tokens: int, hash_len: int = 16) -> int:
        """The size of one block's file."""
        return HEADER.size + hash_len + 8 * num_tokens + self.payload_bytes

    def path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + SUFFIX)

    def exists(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    def touch(self, block_hash: bytes) -> bool:
        """Mark the file recently used; False if there is none."""
        try:
            os.utime(self.path(block_hash))
            return True
        except FileNotFoundError:
            return False

    def stored_hashes(self, limit: int) -> list[bytes]:
        """The hashes of the block files in the directory now, read from their names alone (no
        file is opened): at most ``limit``, the most recently used ones when there are more. A
        name is no proof of its bytes: ``read`` verifies every block it gives back."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        found: list[tuple[bytes, os.DirEntry]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                block_hash = _hash_of(entry.name)
                if block_hash is not None:
                    found.append((block_hash, entry))
        if len(found) <= limit:
            return [block_hash for block_hash, _ in found]
        dated = []
        for block_hash, entry in found:  # a stat each only past the bound: the newest are kept
            try:
                dated.append((entry.stat().st_mtime_ns, block_hash))
            except FileNotFoundError:
                continue
        dated.sort(reverse=True)
        return [block_hash for _, block_hash in dated[:limit]]

    def bytes_used(self) -> int:
        """The total size of the directory's block files, as the writers counted it."""
        raw = os.pread(self._lock_fd, 8, 0)
        return int.from_bytes(raw, "little") if len(raw) == 8 else 0

    # ---- writing ---------------------------------------------------------------------
    def write(self, block_hash: bytes, token_ids: Sequence[int], payload: np.ndarray) -> tuple[bool, list[bytes]]:
        """Store ``payload`` (uint8, ``payload_bytes``) as the block ``block_hash`` of
        ``token_ids``: (whether a file was added, the hashes of the files evicted for it)."""
        meta = block_hash + np.asarray(token_ids, dtype="<i8").tobytes()
        checksum = xxhash.xxh3_64(meta)
        checksum.update(payload)
        header = HEADER.pack(MAGIC, VERSION, len(block_hash), len(token_ids), self.payload_bytes, checksum.intdigest())
        size = len(header) + len(meta) + self.payload_bytes
        if size > self.capacity_bytes:
            return False, []
        temp = os.path.join(self.directory, f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{block_hash.hex()}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, [header, meta, memoryview(payload).cast("B")])
        finally:
            os.close(fd)
        try:
            return self._commit(temp, block_hash, size)
        except BaseException:
            _unlink(temp)
            raise

    def _commit(self, temp: str, block_hash: bytes, size: int) -> tuple[bool, list[bytes]]:
        with self._locked():
            if self.touch(block_hash):  # another process stored it meanwhile
                _unlink(temp)
                return False, []
            used, evicted = self._count(), []
            if used + size > self.capacity_bytes:
                used, evicted = self._evict(int(self.capacity_bytes * LOW_WATER) - size)
            os.rename(temp, self.path(block_hash))
            self._set_count(used + size)
            return True, evicted

    def _evict(self, target: int) -> tuple[int, list[bytes]]:
        """Unlink the least recently used files until at most ``max(target, 0)`` bytes remain
        (lock held): the bytes left and the hashes removed. The scan recounts the total."""
        files, now = [], time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime_ns, st.st_size, entry.name))
                elif entry.name.startswith(TEMP_PREFIX) and now - st.st_mtime > STALE_TEMP_S:
                    _unlink(entry.path)
        files.sort()
        used, removed = sum(size for _, size, _ in files), []
        for _, size, name in files:
            if used <= max(target, 0):
                break
            if _unlink(os.path.join(self.directory, name)):
                removed.append(bytes.fromhex(name[:-len(SUFFIX)]))
            used -= size
        return used, removed

    # ---- reading ---------------------------------------------------------------------
    def read(self, block_hash: bytes, token_ids: Sequence[int], out: np.ndarray) -> ReadResult:
        """Read block ``block_hash`` of ``token_ids`` into ``out`` (uint8, ``payload_bytes``;
        its contents are undefined unless HIT) and verify it. A file that does not match is
        deleted (CORRUPT)."""
        try:
            fd = os.open(self.path(block_hash), os.O_RDONLY)
        except FileNotFoundError:
            return ReadResult.MISS
        try:
            ok = self._read_verified(fd, block_hash, token_ids, out)
        finally:
            os.close(fd)
        if ok:
            self.touch(block_hash)
            return ReadResult.HIT
        self.remove(block_hash)
        return ReadResult.CORRUPT

    def _read_verified(self, fd: int, block_hash: bytes, token_ids: Sequence[int], out: np.ndarray) -> bool:
        head = os.read(fd, HEADER.size)
        if len(head) != HEADER.size:
            return False
        magic, version, hash_len, num_tokens, payload_bytes, checksum = HEADER.unpack(head)
        if (magic, version, hash_len, num_tokens, payload_bytes) != (
                MAGIC, VERSION, len(block_hash), len(token_ids), self.payload_bytes):
            return False
        meta_len = hash_len + 8 * num_tokens
        meta = os.read(fd, meta_len)
        want = block_hash + np.asarray(token_ids, dtype="<i8").tobytes()
        if meta != want:  # a short read, another block's hash, or other tokens
            return False
        view = memoryview(out).cast("B")
        if _read_into(fd, view) != payload_bytes or os.read(fd, 1):  # short, or longer than its header says
            return False
        digest = xxhash.xxh3_64(meta)
        digest.update(view)
        return digest.intdigest() == checksum

    def remove(self, block_hash: bytes) -> bool:
        """Delete block ``block_hash``'s file (found corrupt); False if it was gone."""
        path = self.path(block_hash)
        with self._locked():
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                return False
            if not _unlink(path):
                return False
            self._set_count(max(self._count() - size, 0))
            return True

    def close(self) -> None:
        os.close(self._lock_fd)

    # ---- the shared count --------------------------------------------------------------
    def _locked(self):
        return _FileLock(self._mutex, self._lock_fd)

    def _count(self) -> int:
        return self.bytes_used()

    def _set_count(self, used: int) -> None:
        os.pwrite(self._lock_fd, used.to_bytes(8, "little"), 0)


class _FileLock:
    """This process's mutex, then the directory's ``flock``: one writer at a time, host-wide."""

    def __init__(self, mutex: threading.Lock, fd: int):
        self.mutex, self.fd = mutex, fd

    def __enter__(self) -> None:
        self.mutex.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.mutex.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.mutex.release()


def _write_all(fd: int, parts: list) -> None:
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            view = view[os.write(fd, view):]


def _read_into(fd: int, view: memoryview) -> int:
    done = 0
    while done < len(view):
        got = os.readv(fd, [view[done:]])
        if got == 0:
            break
        done += got
    return done


def _hash_of(name: str) -> bytes | None:
    """The chained hash a block file's name holds; None for any other name (the lock file, a
    temporary file, anything else put there)."""
    if not name.endswith(SUFFIX):
        return None
    try:
        block_hash = bytes.fromhex(name[:-len(SUFFIX)])
    except ValueError:
        return None
    return block_hash if block_hash and block_hash.hex() + SUFFIX == name else None  # as ``path`` names it


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False

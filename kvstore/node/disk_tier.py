"""A store node's second tier: whole blocks as files in a directory, bounded, crash-safe.

The arena (``BlockPool``) is RAM; this tier holds what the node evicted from it for space, so
the node keeps more than its DRAM and its cache outlives a restart. Layout of ``disk_dir``::

    tier.json              format version and which data key wrote the blocks
    lock                   flock'ed by the one store node using the directory
    blocks/ab/<key hex>    one encoded block per file (design.md §3.2), named by its key
    tmp/                   files being written; never read, emptied at start

A block becomes visible only whole: it is written under ``tmp/``, then renamed into
``blocks/`` (rename is atomic), so a node killed mid-write leaves a temp file, never a torn
block. Nothing is trusted because it is on disk: at start every file's header is parsed and its
length checked against the layout the header states (torn, truncated or foreign files are
removed), reads go through ``disk_reads`` (``O_DIRECT`` where the filesystem allows, a
batch pipelined over reader threads), and every read is verified again by the pool that reads
it (``verify_block_self``) and by the reader, like an arena read. The tier never holds more
than ``capacity_bytes`` (file sizes rounded up to 4 KiB): a write first drops the least
recently used files.

Errors are the caller's to count: ``write`` and ``read_into`` raise ``OSError`` as the kernel
gave it (ENOSPC, EIO, EROFS), and a file found damaged is removed and reported by key.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from kvstore.block import stated_nbytes
from kvstore.constants import KEY_NBYTES
from kvstore.errors import BlockCorrupted, BlockNotFound, KVStoreError
from kvstore.node.disk_reads import BlockFileReader

log = logging.getLogger(__name__)

#: Bumped when the directory layout changes; a directory of another format is emptied.
FORMAT_VERSION = 1
#: File sizes are counted in filesystem blocks against the capacity.
_FS_BLOCK = 4096
#: Bytes read to parse a header (a header of up to 256 tokens fits; longer ones read again).
_HEAD_READ = 8192


def _fs_nbytes(nbytes: int) -> int:
    return -(-nbytes // _FS_BLOCK) * _FS_BLOCK


def data_key_id(data_key: bytes | None) -> str:
    """A short public name for the data key the blocks were written under ("" = none): a
    directory written under another key holds blocks no reader of this cluster can use."""
    if not data_key:
        return ""
    return hashlib.sha256(b"kvstore disk tier\0" + data_key).hexdigest()[:16]


@dataclass(slots=True)
class DiskEntry:
    """One block file: its size and what the index needs to announce it."""

    nbytes: int
    parent_key: bytes
    namespace_root: bytes


@dataclass(slots=True)
class DiskCounters:
    """What the tier did since it opened (the pool adds hits, promotions and drops)."""

    recovered: int = 0  # whole block files found at start
    discarded: int = 0  # files removed at start: torn, truncated, foreign, another data key
    lru_drops: int = 0  # files dropped to make room for newer ones
    bytes_written: int = 0
    bytes_read: int = 0


class DiskTierInUse(KVStoreError):
    """Another live store node holds the disk directory."""


class DiskTier:
    """Block files under one directory, least recently used first out; thread-safe."""

    def __init__(self, directory: str, capacity_bytes: int, *,
                 data_key: bytes | None = None, fsync: bool = False,
                 read_path: str = "direct", read_threads: int = 2) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk capacity must be > 0 bytes, got {capacity_bytes}")
        self.directory = os.path.abspath(directory)
        self.capacity_bytes = capacity_bytes
        self._fsync = fsync
        self._reader = BlockFileReader(read_path, read_threads)
        self._blocks_dir = os.path.join(self.directory, "blocks")
        self._tmp_dir = os.path.join(self.directory, "tmp")
        os.makedirs(self._blocks_dir, exist_ok=True)
        os.makedirs(self._tmp_dir, exist_ok=True)
        self._lock_fd = self._take_lock()
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # first = LRU
        self._used = 0
        self._tmp_ids = itertools.count()
        self.counters = DiskCounters()
        self.recovery_s = 0.0
        start = time.monotonic()
        self._check_manifest(data_key_id(data_key))
        self._recover()
        self.recovery_s = time.monotonic() - start

    # -- opening ----------------------------------------------------------------------------

    def _take_lock(self) -> int:
        fd = os.open(os.path.join(self.directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskTierInUse(
                f"disk tier {self.directory} is in use by another store node on this machine; "
                "give each node its own pool.disk_dir") from None
        return fd

    def _check_manifest(self, key_id: str) -> None:
        """Keep the blocks only if this directory's format and data key are ours."""
        path = os.path.join(self.directory, "tier.json")
        want = {"format": FORMAT_VERSION, "data_key_id": key_id}
        try:
            with open(path) as f:
                have = json.load(f)
        except (OSError, ValueError):
            have = None
        if have is not None and have != want:
            log.warning("kvstore disk tier %s was written with %s, this node runs with %s: "
                        "its blocks cannot be read here and are removed", self.directory,
                        have, want)
            shutil.rmtree(self._blocks_dir, ignore_errors=True)
            os.makedirs(self._blocks_dir, exist_ok=True)
        if have != want:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(want, f)
            os.replace(tmp, path)

    def _recover(self) -> None:
        """Index the whole files a previous run left, oldest first; remove everything else."""
        for name in os.listdir(self._tmp_dir):  # writes a crash cut short
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._tmp_dir, name))
        found: list[tuple[float, bytes, DiskEntry]] = []
        for sub in os.listdir(self._blocks_dir):
            subdir = os.path.join(self._blocks_dir, sub)
            if not os.path.isdir(subdir):
                continue
            for name in os.listdir(subdir):
                path = os.path.join(subdir, name)
                got = self._inspect(path, name)
                if got is None:
                    self.counters.discarded += 1
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
                found.append(got)
        found.sort(key=lambda item: item[0])
        for _, key, entry in found:
            if self._used + _fs_nbytes(entry.nbytes) > self.capacity_bytes:
                # the capacity shrank since: keep the newest that fit
                self._drop_oldest_locked(_fs_nbytes(entry.nbytes), count=False)
            self._entries[key] = entry
            self._used += _fs_nbytes(entry.nbytes)
        self.counters.recovered = len(self._entries)

    def _inspect(self, path: str, name: str) -> tuple[float, bytes, DiskEntry] | None:
        """(mtime, key, entry) of a file whose name, header and length agree, else None."""
        try:
            key = bytes.fromhex(name)
        except ValueError:
            return None
        if len(key) != KEY_NBYTES:
            return None
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                head = f.read(_HEAD_READ)
                try:
                    header, nbytes = stated_nbytes(head)
                except BlockCorrupted:
                    header, nbytes = stated_nbytes(head + f.read(1 << 20))  # a long header
        except (OSError, BlockCorrupted):
            return None
        if header.key != key or nbytes != st.st_size:
            return None
        return st.st_mtime, key, DiskEntry(nbytes, header.parent_key, header.namespace_root)

    # -- queries ---------------------------------------------------------------------------

    def path_of(self, key: bytes) -> str:
        hexkey = key.hex()
        return os.path.join(self._blocks_dir, hexkey[:2], hexkey)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            entries = self._entries
            return [k in entries for k in keys]

    def entry(self, key: bytes) -> DiskEntry | None:
        with self._lock:
            return self._entries.get(key)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def items(self) -> list[tuple[bytes, DiskEntry]]:
        with self._lock:
            return list(self._entries.items())

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks as just used (the tier's LRU order)."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    # -- reads -----------------------------------------------------------------------------

    def read_into(self, key: bytes, dest: memoryview) -> int:
        """Read block ``key`` into ``dest`` (exactly its size) by the tier's read path
        (``disk_reads``). Raises BlockNotFound, BlockCorrupted (a file shorter than its
        entry) or the OSError of a failing disk."""
        got = next(self.read_many([key], [dest]))
        if isinstance(got, Exception):
            raise got
        return got

    def read_many(self, keys: Sequence[bytes], dests: Sequence[memoryview]
                  ) -> Generator[int | Exception, None, None]:
        """``read_into`` for a batch (one lease's blocks), pipelined on the reader threads
        and yielded in order: per key the bytes read or the exception (BlockNotFound,
        BlockCorrupted, OSError). Close the iterator early and the reads in flight finish
        first, so no ``dest`` is written afterwards."""
        jobs: list[tuple[str, memoryview]] = []
        early: dict[int, Exception] = {}
        with self._lock:
            for i, (key, dest) in enumerate(zip(keys, dests, strict=True)):
                entry = self._entries.get(key)
                if entry is None:
                    early[i] = BlockNotFound(f"block {key.hex()[:16]} is not on disk")
                    continue
                if len(dest) != entry.nbytes:
                    raise ValueError(f"destination of {len(dest)} bytes for a "
                                     f"{entry.nbytes}-byte block")
                self._entries.move_to_end(key)
                jobs.append((self.path_of(key), dest))
        results = self._reader.read_many(jobs)
        try:
            for i in range(len(keys)):
                got: int | Exception = early[i] if i in early else next(results)
                if isinstance(got, int):
                    with self._lock:
                        self.counters.bytes_read += got
                yield got
        finally:
            results.close()

    @property
    def read_path(self) -> str:
        """How block files are read: ``direct`` (O_DIRECT) or ``buffered`` (page cache)."""
        return self._reader.read_path

    # -- writes ----------------------------------------------------------------------------

    def write(self, key: bytes, data: memoryview | bytes, parent_key: bytes,
              namespace_root: bytes) -> list[bytes]:
        """Store one whole block (temp file, then rename); returns the keys dropped, least
        recently used first, to make room. A block already on disk is left as it is; one
        larger than the whole tier is refused with ENOSPC. Raises the OSError of a failing
        disk, after removing its temp file."""
        nbytes = len(data)
        need = _fs_nbytes(nbytes)
        if need > self.capacity_bytes:
            raise OSError(errno.ENOSPC, f"a {nbytes}-byte block is larger than the disk "
                                        f"tier's {self.capacity_bytes} bytes")
        with self._lock:
            if key in self._entries:
                return []
            dropped = self._drop_oldest_locked(need)
            self._used += need  # claimed now, so concurrent writers never overshoot
        final = self.path_of(key)
        tmp = os.path.join(self._tmp_dir, f"{key.hex()}.{os.getpid()}.{next(self._tmp_ids)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data).cast("B")
                done = 0
                while done < nbytes:
                    done += os.pwrite(fd, view[done:], done)
                if self._fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._used -= need
            raise
        with self._lock:
            self._entries[key] = DiskEntry(nbytes, parent_key, namespace_root)
            self.counters.bytes_written += nbytes
        return dropped

    def make_room(self, nbytes: int) -> list[bytes]:
        """Drop least recently used files until ``nbytes`` more fit (or the tier is empty):
        after ENOSPC the filesystem, not the capacity, is the limit."""
        with self._lock:
            return self._drop_oldest_locked(_fs_nbytes(nbytes), target=self._used)

    def delete(self, key: bytes) -> bool:
        """Remove a block's file; False if the tier did not hold it."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._used -= _fs_nbytes(entry.nbytes)
        self._unlink(key)
        return True

    def purge(self) -> None:
        """Remove every block (``kvstore stop --purge``); the tier stays usable."""
        with self._lock:
            self._entries.clear()
            self._used = 0
            shutil.rmtree(self._blocks_dir, ignore_errors=True)
            os.makedirs(self._blocks_dir, exist_ok=True)

    def close(self, *, remove: bool = False) -> None:
        """Let the directory go (``remove``: with everything in it)."""
        if self._lock_fd < 0:
            return
        self._reader.close()
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)
        self._lock_fd = -1

    # -- internals -------------------------------------------------------------------------

    def _drop_oldest_locked(self, need: int, *, count: bool = True,
                            target: int | None = None) -> list[bytes]:
        """Drop LRU files until ``need`` more bytes fit under the capacity (or, with
        ``target``, under that)."""
        limit = self.capacity_bytes if target is None else target
        dropped: list[bytes] = []
        while self._entries and self._used + need > limit:
            key, entry = self._entries.popitem(last=False)
            self._used -= _fs_nbytes(entry.nbytes)
            self._unlink(key)
            dropped.append(key)
        if count:
            self.counters.lru_drops += len(dropped)
        return dropped

    def _unlink(self, key: bytes) -> None:
        # a reader with the file open keeps reading it: unlink never cuts a read short
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_of(key))

"""The synced code on a host: a content-addressed store under the worker's ``path``.

Layout (docs/code-and-environment.md)::

    <path>/.fdl-code/
        objects/ab/<sha256>.<mode>   each file's content once, with its mode
        trees/<tree>/                one snapshot of the synced folder: files are hard
                                     links to objects, symlinks and folders as sent
        trees/<tree>.lock            held (shared flock) by every agent running that tree
        tmp/                         objects and trees while they arrive
        current -> trees/<tree>      the newest snapshot, for people (ranks never use it)

Why a snapshot per version rather than syncing into ``path`` itself: a sync must never
change files under a live run, and two runs of two versions on one host must both see
their own code. A tree is complete before it is renamed into ``trees/`` and is never
changed after, so a rank's folder stays what it was when the rank started; an unchanged
file costs a hard link, not a copy, so a new version costs only what changed.

A tree is removed only when it is not among the newest `KEEP_TREES`, no agent holds its
lock (a live run), and no setup record names it; an object when no tree links it any
more (link count 1). Standard library only: this runs inside the agent.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
from typing import Any, Dict, List, Optional, Set, Tuple

#: The store's folder under the worker's ``path``.
STORE = ".fdl-code"
#: Snapshots kept beyond those in use.
KEEP_TREES = 8
#: Bytes kept free on the host's file system beyond what a sync writes.
FREE_MARGIN = 16 * 1024 * 1024
#: SYNC_DATA head: the entry's index (u32), flags (u8: LAST).
DATA_HEAD = struct.Struct(">IB")
LAST = 1
#: Entry kinds in a manifest.
FILE, LINK, DIR = "f", "l", "d"


class StoreError(Exception):
    """A sync cannot be done on this host; the words say what to fix."""


def human(n: float) -> str:
    """Bytes in the units people read (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def object_name(sha: str, mode: int) -> str:
    return f"{sha[:2]}/{sha}.{mode & 0o7777:o}"


def _checked_rel(rel: str) -> str:
    """A manifest path must stay inside the tree: relative, no ``..``, no NUL."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\x00" in rel or \
            any(part in ("", ".", "..") for part in rel.split("/")):
        raise StoreError(f"the manifest names a path outside the folder: {rel!r}")
    return rel


class Store:
    """One host's store; one sync at a time per agent (`begin`, `receive`, `finish`)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.root = os.path.join(self.path, STORE)
        self.entries: List[List[Any]] = []
        self.tree = ""
        self.need: Dict[int, str] = {}
        self.received = 0
        self._part: Optional[Tuple[int, Any, str, Any]] = None
        self.lock_fd: Optional[int] = None
        self.also: List[int] = []
        #: Objects asked for in this sync (none when the host had the tree).
        self.asked = 0
        #: Object folders known to exist (``objects/ab``): created once each.
        self._folders: Set[str] = set()

    # -- what is missing ---------------------------------------------------------------
    def ask(self, tree: str) -> bool:
        """Whether this host has ``tree`` already (then `finish` puts it in use): the one
        round trip of a launch that changed nothing."""
        self.tree = str(tree or "")
        if not self.tree.isalnum():
            raise StoreError(f"bad tree id {self.tree!r}")
        self._prepare()
        return os.path.isdir(self.tree_dir)

    def _prepare(self) -> None:
        try:
            for sub in ("objects", "trees", "tmp"):
                os.makedirs(os.path.join(self.root, sub), exist_ok=True)
            ignore = os.path.join(self.root, ".gitignore")
            if not os.path.exists(ignore):  # a store inside a work tree stays out of git
                with open(ignore, "w", encoding="utf-8") as f:
                    f.write("# fdl-fabric's synced code (docs/code-and-environment.md)\n*\n")
        except OSError as exc:
            raise StoreError(f"cannot write under {self.path}: {exc.strerror or exc}") from None
        if not os.access(self.root, os.W_OK):
            raise StoreError(f"cannot write under {self.path}: permission denied")

    def begin(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """Read the manifest of the tree `ask` named; say which objects this host lacks."""
        entries = request.get("entries")
        if not isinstance(entries, list):
            raise StoreError("the manifest has no entries")
        self.entries = entries
        for entry in entries:
            _checked_rel(entry[0])
        have = os.path.isdir(self.tree_dir)
        self.need = {}
        size = 0
        if not have:
            wanted: Dict[str, int] = {}
            for i, entry in enumerate(entries):
                if entry[1] != FILE:
                    continue
                name = object_name(str(entry[4]), int(entry[2]))
                if name in wanted or self._have_object(name, int(entry[3])):
                    continue
                wanted[name] = i
                self.need[i] = name
                size += int(entry[3])
        free = self.free()
        if size and size + FREE_MARGIN > free:
            raise StoreError(f"not enough space under {self.path}: the sync needs "
                             f"{human(size)}, {human(free)} free")
        self.received = 0
        self.asked = len(self.need)
        return {"tree": self.tree, "have": have, "need": sorted(self.need),
                "bytes": size, "free": free, "root": self.root}

    @property
    def tree_dir(self) -> str:
        return os.path.join(self.root, "trees", self.tree)

    def free(self) -> int:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _have_object(self, name: str, size: int) -> bool:
        try:
            return os.stat(os.path.join(self.root, "objects", name)).st_size == size
        except OSError:
            return False

    @property
    def complete(self) -> bool:
        return not self.need and self._part is None

    # -- receiving ---------------------------------------------------------------------
    def receive(self, body: bytes) -> bool:
        """One SYNC_DATA chunk; True once the last object has arrived."""
        if len(body) < DATA_HEAD.size:
            raise StoreError("short data frame")
        index, flags = DATA_HEAD.unpack_from(body)
        data = memoryview(body)[DATA_HEAD.size:]
        if self._part is None or self._part[0] != index:
            if self._part is not None:
                raise StoreError(f"object {self._part[0]} was cut short")
            name = self.need.get(index)
            if name is None:
                raise StoreError(f"data for entry {index}, which was not asked for")
            tmp = os.path.join(self.root, "tmp", f"{os.getpid()}.{index}")
            f = open(tmp, "wb")  # noqa: SIM115 - kept open across frames, closed at LAST
            self._part = (index, f, tmp, hashlib.sha256())
        f = self._part[1]
        self._part[3].update(data)
        try:
            f.write(data)
        except OSError as exc:
            self._abandon()
            raise self._write_error(exc) from None
        self.received += len(data)
        if flags & LAST:
            self._finish_object()
        return self.complete

    def _write_error(self, exc: OSError) -> StoreError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreError(f"the disk under {self.path} is full ({human(self.free())} "
                              "free)")
        return StoreError(f"cannot write under {self.path}: {exc.strerror or exc}")

    def _finish_object(self) -> None:
        assert self._part is not None
        index, f, tmp, digest = self._part
        self._part = None
        entry = self.entries[index]
        try:
            f.close()
            if os.path.getsize(tmp) != int(entry[3]) or digest.hexdigest() != entry[4]:
                os.unlink(tmp)
                raise StoreError(f"{entry[0]} changed while it was sent (its content is not "
                                 "what the manifest says); run the launch again once it "
                                 "is written")
            os.chmod(tmp, int(entry[2]) & 0o7777)
            os.utime(tmp, ns=(int(entry[5]), int(entry[5])))
            final = os.path.join(self.root, "objects", self.need.pop(index))
            folder = os.path.dirname(final)
            if folder not in self._folders:
                os.makedirs(folder, exist_ok=True)
                self._folders.add(folder)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._write_error(exc) from None

    def _abandon(self) -> None:
        if self._part is not None:
            with contextlib.suppress(OSError):
                self._part[1].close()
                os.unlink(self._part[2])
            self._part = None

    # -- the tree ----------------------------------------------------------------------
    def finish(self) -> Dict[str, Any]:
        """Build the tree (unless it exists), hold its lock, point ``current`` at it."""
        if not os.path.isdir(self.tree_dir):
            self._build()
        self.hold()
        with contextlib.suppress(OSError):
            link = os.path.join(self.root, f"current.{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
            os.symlink(os.path.join("trees", self.tree), link)
            os.replace(link, os.path.join(self.root, "current"))
        with contextlib.suppress(OSError):
            os.utime(self.tree_dir)  # newest use: kept longest
        return {"tree": self.tree, "dir": self.tree_dir, "received": self.received,
                "files": self.asked, "root": self.root}

    def _build(self) -> None:
        tmp = os.path.join(self.root, "tmp", f"tree-{self.tree}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.mkdir(tmp, 0o755)
            dirs: List[Tuple[str, int]] = []
            made = {tmp}
            for entry in self.entries:
                rel, kind = entry[0], entry[1]
                target = os.path.join(tmp, rel)
                if kind == DIR:
                    os.makedirs(target, exist_ok=True)
                    made.add(target)
                    dirs.append((target, int(entry[2])))
                    continue
                parent = os.path.dirname(target)
                if parent not in made:  # the manifest lists folders first: rarely
                    os.makedirs(parent, exist_ok=True)
                    made.add(parent)
                if kind == LINK:
                    os.symlink(str(entry[4]), target)
                else:
                    name = object_name(str(entry[4]), int(entry[2]))
                    os.link(os.path.join(self.root, "objects", name), target)
            for folder, mode in reversed(dirs):
                os.chmod(folder, mode & 0o7777)
            try:
                os.rename(tmp, self.tree_dir)
            except OSError as exc:  # another launch built the same tree meanwhile
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._write_error(exc) from None

    def hold(self) -> None:
        """A shared lock on the tree for as long as this agent lives: a live run's tree
        is never collected (the kernel lets go when the agent ends, however it ends)."""
        fd = os.open(self.tree_dir + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
        self.lock_fd = fd

    def hold_also(self, tree: str) -> None:
        """Also hold ``tree`` (where setup made what this tree links): it must outlive
        every run of a tree that links it."""
        with contextlib.suppress(OSError):
            fd = os.open(tree + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self.also.append(fd)

    def collect(self, keep: int = KEEP_TREES) -> int:
        """Remove old trees nobody runs, then objects no tree links; the count removed."""
        trees_dir = os.path.join(self.root, "trees")
        kept = set(keep_named(self.root))
        kept.add(self.tree)
        trees: List[Tuple[float, str]] = []
        for name in os.listdir(trees_dir):
            path = os.path.join(trees_dir, name)
            if name.endswith(".lock") or name in kept or not os.path.isdir(path):
                continue
            with contextlib.suppress(OSError):
                trees.append((os.stat(path).st_mtime, name))
        trees.sort(reverse=True)
        removed = 0
        for _, name in trees[max(0, keep - 1):]:
            if _remove_if_unused(os.path.join(trees_dir, name)):
                removed += 1
        if removed:
            objects = os.path.join(self.root, "objects")
            for sub in os.listdir(objects):
                folder = os.path.join(objects, sub)
                for obj in os.listdir(folder) if os.path.isdir(folder) else ():
                    path = os.path.join(folder, obj)
                    with contextlib.suppress(OSError):
                        if os.lstat(path).st_nlink == 1:
                            os.unlink(path)
        return removed


def _remove_if_unused(tree: str) -> bool:
    """Remove ``tree`` unless an agent holds its lock."""
    try:
        fd = os.open(tree + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        shutil.rmtree(tree, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(tree + ".lock")
        return not os.path.exists(tree)
    finally:
        os.close(fd)


def keep_named(root: str) -> List[str]:
    """Trees a setup record names: later versions link what setup made in them."""
    names: List[str] = []
    folder = os.path.join(root, "setup")
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError), \
                    open(os.path.join(folder, name), encoding="utf-8") as f:
                names.append(str(json.load(f)["tree"]))
    return names


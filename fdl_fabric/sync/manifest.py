"""What a sync sends: the manifest of the local folder (``sync.src``), its tree id and
the run's code id. Nothing here contacts a host.

Which files: when ``src`` is in a git work tree, what ``git ls-files --cached --others
--exclude-standard`` lists (so ``.gitignore``, ``.git/info/exclude`` and the global
excludes hold, as SkyPilot reads them); otherwise every file under ``src``. Then
``.fdlignore`` at the top of ``src`` and ``sync.exclude`` (gitignore patterns, read by
`pathspec`), and always `NEVER` plus the run records and ``--log-dir`` when they lie
inside ``src``.

Each file's content hash is kept in a cache on the controller, keyed by its size, mtime,
inode and ctime (as git's index does), so a launch that changed nothing hashes nothing.
A file modified within `RACY_SECONDS` of now is hashed again next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..agent.wire import MAX_FRAME
from ..clusterfile.model import SyncSpec
from ..errors import EXIT_USAGE, FdlError

if TYPE_CHECKING:
    import pathspec

#: Never sent, whatever the patterns say: git's own folder, the host store's folder,
#: Python's caches (each host compiles its own).
NEVER = (".git/", ".fdl-code/", "__pycache__/", "*.pyc")
#: The file of patterns read at the top of ``src`` (gitignore syntax), like .skyignore.
IGNORE_FILE = ".fdlignore"
#: A file this recent may still change within its mtime's granularity: not cached.
RACY_SECONDS = 2.0
#: Files in one manifest, at most: a manifest travels to every host in one frame
#: (`agent.wire.MAX_FRAME`, 16 MiB; an entry takes about 120 bytes).
FILES_MAX = 100_000
#: Bytes of the manifest as it travels, at most: one agent frame, with room to spare.
MANIFEST_MAX = MAX_FRAME - (1 << 20)
#: Seconds ``git`` may take to list the files.
GIT_TIMEOUT = 30.0


@dataclass(frozen=True)
class Entry:
    """One path of the manifest: a file (its content hash), a symlink (its target,
    relative) or a folder."""

    rel: str
    kind: str
    mode: int
    size: int = 0
    ref: str = ""
    mtime_ns: int = 0

    def wire(self) -> list[object]:
        return [self.rel, self.kind, self.mode, self.size, self.ref, self.mtime_ns]


@dataclass(frozen=True)
class Manifest:
    src: str
    entries: tuple[Entry, ...]
    #: The tree's id: a hash of every path, kind, mode and content (not of mtimes).
    tree: str
    #: What the run says it ran: ``git:<commit>`` (+ ``+<tree>`` with uncommitted
    #: changes), or ``tree:<tree>`` outside a work tree.
    code_id: str
    excluded: int = 0

    @property
    def files(self) -> int:
        return sum(1 for e in self.entries if e.kind == "f")

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "f")

    def wire(self) -> list[list[object]]:
        return [e.wire() for e in self.entries]


def build(spec: SyncSpec, *, never: Sequence[str] = (), cache_dir: Optional[Path] = None
          ) -> Manifest:
    """The manifest of ``spec.src``; ``never``: absolute folders never sent (the run
    records, ``--log-dir``). A missing ``src`` or a symlink out of it is refused (exit 2)."""
    src = os.path.abspath(spec.src)
    if not os.path.isdir(src):
        where = f" (sync.src, line {spec.line})" if spec.line else ""
        raise FdlError(f"cluster launcher: sync: {src}{where} is not a folder; set sync.src "
                       "to the folder to send, or use --no-sync", EXIT_USAGE)
    git = _git_root(src)
    listed = list(_git_files(src) if git else _walk(src))
    patterns = [*NEVER, *_read_ignore(src), *spec.exclude]
    patterns += [_anchored(src, n) for n in never if _inside(src, n)]
    cache = _HashCache(src, cache_dir)
    import pathspec  # here, not at the top: a launch with nothing to sync never pays for it

    entries, excluded = _entries(src, listed, pathspec.GitIgnoreSpec.from_lines(patterns),
                                 cache)
    cache.save()
    ordered = tuple(entries[k] for k in sorted(entries))
    size = len(json.dumps([e.wire() for e in ordered], separators=(",", ":")))
    if size > MANIFEST_MAX:
        raise FdlError(f"cluster launcher: sync: the manifest of {src} takes {size >> 20} MiB, "
                       f"more than the {MANIFEST_MAX >> 20} MiB one message may carry; "
                       "exclude what the ranks do not need (sync.exclude)", EXIT_USAGE)
    tree = _tree_id(ordered)
    return Manifest(src=src, entries=ordered, tree=tree,
                    code_id=_code_id(src, tree) if git else f"tree:{tree}", excluded=excluded)


def _entries(src: str, listed: Iterable[str], spec: pathspec.GitIgnoreSpec,
             cache: _HashCache) -> tuple[dict[str, Entry], int]:
    """The entries of the ``listed`` paths ``spec`` does not exclude, with their parent
    folders, by path; and how many were excluded. Over `FILES_MAX` is refused (exit 2)."""
    entries: dict[str, Entry] = {}
    excluded = 0
    real_src = os.path.realpath(src)
    for rel in listed:
        if spec.match_file(rel):  # a folder's pattern (data/) matches the files in it
            excluded += 1
            continue
        entry = _entry(src, real_src, rel, cache)
        if entry is None:
            continue
        for parent in _parents(rel):
            if parent not in entries:
                entries[parent] = Entry(parent, "d", _mode(os.path.join(src, parent)))
        entries[rel] = entry
        if len(entries) > FILES_MAX:
            raise FdlError(f"cluster launcher: sync: {src} has more than {FILES_MAX:,} files "
                           "to send; exclude what the ranks do not need (sync.exclude)",
                           EXIT_USAGE)
    return entries, excluded


# -- listing ---------------------------------------------------------------------------------
def _git(src: str, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", src, *args], capture_output=True,
                              timeout=GIT_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode("utf-8", "surrogateescape") if done.returncode == 0 else None


def _git_root(src: str) -> bool:
    out = _git(src, "rev-parse", "--is-inside-work-tree")
    return out is not None and out.strip() == "true"


def _git_files(src: str) -> Iterator[str]:
    out = _git(src, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if out is None:
        yield from _walk(src)
        return
    for rel in sorted(set(out.split("\0")) - {""}):
        path = os.path.join(src, rel)
        if os.path.isdir(path) and not os.path.islink(path):  # a submodule: all of it
            yield from (os.path.join(rel, r) for r in _walk(path))
        else:
            yield rel


def _walk(src: str) -> Iterator[str]:
    for folder, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d != ".git")
        rel_folder = os.path.relpath(folder, src)
        for name in sorted(files):
            yield name if rel_folder == "." else os.path.join(rel_folder, name)
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                yield name if rel_folder == "." else os.path.join(rel_folder, name)


def _read_ignore(src: str) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(src, IGNORE_FILE).read_text(encoding="utf-8").splitlines()
    return []


def _inside(src: str, path: str) -> bool:
    path = os.path.abspath(path)
    return path != src and path.startswith(src.rstrip("/") + "/")


def _anchored(src: str, path: str) -> str:
    return "/" + os.path.relpath(os.path.abspath(path), src).rstrip("/") + "/"


def _parents(rel: str) -> Iterator[str]:
    parts = rel.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        yield "/".join(parts[:i])


def _mode(path: str) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o755


# -- entries ---------------------------------------------------------------------------------
def _entry(src: str, real_src: str, rel: str, cache: _HashCache) -> Optional[Entry]:
    path = os.path.join(src, rel)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # listed by git, deleted since: not part of the folder any more
    except OSError as exc:
        raise FdlError(f"cluster launcher: sync: cannot read {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        return Entry(rel, "l", 0o777, ref=_link_target(src, real_src, rel))
    if not stat.S_ISREG(st.st_mode):
        return None  # a socket, a fifo, a device: nothing a sync can carry
    return Entry(rel, "f", stat.S_IMODE(st.st_mode), st.st_size, cache.sha(rel, path, st),
                 st.st_mtime_ns)


def _link_target(src: str, real_src: str, rel: str) -> str:
    """The link's target as a path relative to its folder, once it is known to resolve
    inside ``src``; one that leads out of it is refused, never followed."""
    path = os.path.join(src, rel)
    text = os.readlink(path)
    resolved = os.path.realpath(path)
    if resolved != real_src and not resolved.startswith(real_src.rstrip("/") + "/"):
        raise FdlError(f"cluster launcher: sync: {path} is a symlink to {text}, outside "
                       f"{src}; a sync does not follow links out of its folder: copy what "
                       "it points at into the folder, or exclude it (sync.exclude)",
                       EXIT_USAGE)
    if os.path.isabs(text):
        text = os.path.relpath(os.path.join(real_src, os.path.relpath(resolved, real_src)),
                               os.path.dirname(os.path.join(real_src, rel)))
    return text


def _tree_id(entries: Iterable[Entry]) -> str:
    digest = hashlib.sha256()
    for e in entries:
        digest.update(f"{e.rel}\0{e.kind}\0{e.mode:o}\0{e.ref}\n".encode("utf-8",
                                                                        "surrogateescape"))
    return digest.hexdigest()[:20]


def _code_id(src: str, tree: str) -> str:
    head = _git(src, "rev-parse", "--short=12", "HEAD")
    if head is None or not head.strip():
        return f"tree:{tree}"
    status = _git(src, "status", "--porcelain", "--untracked-files=normal", "--", ".",
                  ":(exclude).fdl-code")
    dirty = bool(status and status.strip())
    return f"git:{head.strip()}" + (f"+{tree[:8]}" if dirty else "")


# -- the hash cache --------------------------------------------------------------------------
def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "fdl-fabric", "hashes")


class _HashCache:
    """Content hashes by (size, mtime, inode, ctime), one private file per ``src``."""

    def __init__(self, src: str, folder: Optional[Path]) -> None:
        name = hashlib.sha256(src.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        self.file = (folder or _cache_root()) / f"{name}.json"
        self.old: dict[str, list[object]] = {}
        self.new: dict[str, list[object]] = {}
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.file.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                self.old = data
        self.now = time.time()

    def sha(self, rel: str, path: str, st: os.stat_result) -> str:
        key = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
        cached = self.old.get(rel)
        if isinstance(cached, list) and cached[:4] == key and isinstance(cached[4], str):
            sha = cached[4]
        else:
            sha = _hash_file(path)
        if self.now - st.st_mtime_ns / 1e9 > RACY_SECONDS:
            self.new[rel] = [*key, sha]
        return sha

    def save(self) -> None:
        if self.new == self.old:
            return
        with contextlib.suppress(OSError):
            self.file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.new, f, separators=(",", ":"))
            os.replace(tmp, self.file)


def _hash_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise FdlError(f"cluster launcher: sync: cannot read {path}: {exc.strerror}") from None

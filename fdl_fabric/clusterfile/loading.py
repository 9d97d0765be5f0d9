"""Reading a cluster file: a regular file of at most 1 MiB, validated in one pass.

`load_cluster` either returns a fully resolved `ClusterSpec` or raises one `ConfigError`
listing every problem, sorted by line, before an SSH connection is opened or a GPU is
touched. `schema` and `yamlread` (and PyYAML) are imported only when a file is parsed,
so commands that build a cluster in code (``fdl-fabric run``) never load them.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import Optional, Union

from ..limits import FILE_MAX_BYTES, PROBLEMS_MAX
from .model import ClusterSpec
from .problems import ConfigError, file_too_big, make_problem
from .schema import read_cluster
from .yamlread import NodeReader, Stop


def this_host_name() -> str:
    """The logical name of this machine, overridable because hostnames are often generic
    (``ubuntu``, container ids) and would not match the names used in the cluster file."""
    override = os.environ.get("FLODL_HOST_NAME", "").strip()
    return override or socket.gethostname()



# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def load_cluster(
    path: Union[str, os.PathLike[str]], *, local_hostname: Optional[str] = None
) -> ClusterSpec:
    """Read and validate a cluster file; relative paths inside it are relative to its folder.

    Only a regular file of at most ``FILE_MAX_BYTES`` is read: a device (``/dev/zero``) or a
    FIFO is refused from its type, before a byte is read, so a wrong ``--cluster`` can
    neither block the launcher nor fill its memory.
    """
    file = os.fspath(path)
    text = _read_text(file)
    folder = os.path.dirname(os.path.abspath(file))
    return parse_cluster(text, file=file, folder=folder, local_hostname=local_hostname)


def _read_text(file: str) -> str:
    def refuse(message: str) -> ConfigError:
        return ConfigError([make_problem(file, "", None, message)])

    try:
        # stat before open: opening some devices has effects, and opening a FIFO for
        # reading waits for a writer.
        kind = _file_kind(os.stat(file).st_mode)
        if kind is not None:
            raise refuse(f"not a regular file ({kind}); a cluster file must be a regular file")
        # O_NONBLOCK: if the path was swapped for a FIFO since the stat, open returns at once
        # and fstat below refuses it.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
        fd = os.open(file, flags | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise refuse("file not found") from None
    except OSError as exc:
        raise refuse(f"cannot read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        kind = _file_kind(info.st_mode)
        if kind is not None:
            raise refuse(f"not a regular file ({kind}); a cluster file must be a regular file")
        if info.st_size > FILE_MAX_BYTES:
            raise refuse(file_too_big(info.st_size))
        chunks: list[bytes] = []
        size = 0
        while size <= FILE_MAX_BYTES:  # st_size can lie (a file still growing, /proc)
            chunk = os.read(fd, FILE_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise refuse(f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > FILE_MAX_BYTES:
        raise refuse(file_too_big(size, at_least=True))
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        message = f"not valid UTF-8 ({exc.reason})"
        raise ConfigError([make_problem(file, "", line, message)]) from None


def _file_kind(mode: int) -> Optional[str]:
    """None for a regular file, else what the path is, in words."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "an unknown kind of file")


def parse_cluster(
    text: str,
    *,
    file: str = "cluster.yml",
    folder: Optional[str] = None,
    local_hostname: Optional[str] = None,
) -> ClusterSpec:
    """Validate cluster YAML given as text; ``file`` and ``folder`` only label and anchor it.

    ``local_hostname`` is a parameter (not read here) so tests and tools can ask "what would
    this file mean on host X" without touching the environment.
    """
    folder = os.path.abspath(folder if folder is not None else os.path.dirname(file) or ".")
    if local_hostname is None:
        local_hostname = this_host_name()
    reader = NodeReader(file)
    spec: Optional[ClusterSpec] = None
    try:
        root = reader.compose(text)
        spec = read_cluster(reader, root, folder, local_hostname) if root is not None else None
    except Stop:
        pass
    if reader.problems or spec is None:
        problems = sorted(reader.problems, key=lambda p: p.line or 0)
        if reader.stopped:
            message = f"stopped after {PROBLEMS_MAX} problems; fix these and check again"
            problems.append(make_problem(file, "", None, message))
        raise ConfigError(problems)
    return spec

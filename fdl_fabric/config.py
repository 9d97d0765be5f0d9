"""The cluster.yml model, and the entry points that read and validate a file.

A cluster file is written by hand and read before anything is launched, so its job is to
turn every mistake in it into a message that points at the exact line, before an SSH
connection is opened or a GPU is touched. A bad file never half-loads: ``load_cluster``
either returns a fully resolved ``ClusterSpec`` or raises one ``ConfigError`` that lists
*every* problem found, sorted by line, so a user fixes the file in one pass.

The work is split by concern:

* this module: the model (frozen dataclasses, defaults applied), the reserved env names,
  and reading the file itself (a regular file of at most 1 MiB, never a FIFO or a device);
* `schema`: the rules of cluster.yml, one function per block;
* `yamlread`: reading YAML nodes with line numbers and bounds, recording problems;
* `names`: the grammar of host names, users, ssh options, paths and commands;
* `limits`: every bound, with its reason.

`schema` and `yamlread` (and PyYAML) load only when a file is parsed, so commands that
build a cluster in code (``fdl-fabric run``) never import them.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass
from typing import Optional, Union

from .limits import (
    FILE_MAX_BYTES,
    PROBLEMS_MAX,
)
from .names import KEY_MAX, MESSAGE_MAX, clip

__all__ = [
    "ENV_NAME_RE",
    "RESERVED_ENV_KEYS",
    "ClusterSpec",
    "ConfigError",
    "ControllerSpec",
    "ElasticSpec",
    "Problem",
    "SlurmSpec",
    "SshSpec",
    "WorkerSpec",
    "is_reserved_env_key",
    "load_cluster",
    "parse_cluster",
    "parse_max_failure",
    "this_host_name",
]

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One mistake, located well enough that an editor can jump to it (``file:line:``)."""

    file: str
    key: str
    line: Optional[int]
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        # A problem with the file as a whole (not found, not a mapping) has no key path.
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(Exception):
    """One or more problems in a cluster file. str() lists every problem, one per line."""

    def __init__(self, problems: list[Problem]) -> None:
        # Passing the list (not the rendered text) to Exception keeps the error picklable,
        # so it survives being raised inside a worker process.
        super().__init__(list(problems))
        self.problems: list[Problem] = list(problems)

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.problems)


def make_problem(file: str, key: str, line: Optional[int], message: str) -> Problem:
    """A problem with every part shortened and printable (see `names.clip`)."""
    return Problem(clip(file, 4096), clip(key, KEY_MAX), line, clip(message, MESSAGE_MAX))


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SshSpec:
    """How to reach a remote worker; every field falls back to the user's ssh config."""

    target: Optional[str] = None
    user: Optional[str] = None
    port: Optional[int] = None
    identity_file: Optional[str] = None
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerSpec:
    """One host of the cluster, fully resolved so launchers never re-apply defaults."""

    index: int
    host: str
    nproc: Optional[int]
    local_devices: Union[tuple[int, ...], str, None]
    path: str
    addr: str
    nccl_socket_ifname: Optional[str]
    ssh: SshSpec
    tunnel: bool
    env: dict[str, str]
    data_path: Optional[str]
    is_local: bool
    line: int
    #: Names or globs of launcher variables carried to this worker's ranks.
    env_forward: tuple[str, ...] = ()
    #: The Slurm job whose allocation holds this node: its agent starts as an srun step
    #: of that job, never over SSH (`fdl_fabric.slurm`).
    slurm_job: Optional[str] = None

    @property
    def ssh_target(self) -> str:
        """``host`` doubles as the ssh destination unless the file says otherwise."""
        return self.ssh.target or self.host


@dataclass(frozen=True)
class SlurmSpec:
    """``scheduler: slurm``: the workers are the nodes of the Slurm allocation the launch
    runs in, each with the same ranks; known only at launch (`fdl_fabric.slurm`)."""

    nproc_per_node: Optional[int] = None
    local_devices: Union[tuple[int, ...], str, None] = None
    #: The ranks' working directory on every node (nodes usually share a file system).
    path: Optional[str] = None
    #: The allocation's job id once the launch resolved it (SLURM_JOB_ID).
    job_id: Optional[str] = None
    line: int = 0


@dataclass(frozen=True)
class ControllerSpec:
    """Where every rank reports; loopback by default so a one-machine run needs no setup."""

    host: str = "127.0.0.1"
    port: int = 1337


@dataclass(frozen=True)
class ElasticSpec:
    """Failure tolerance; timeouts are base values, later scaled by FLODL_NET_TIMEOUT_SCALE."""

    max_failure: Union[int, float, None] = None
    formation_timeout: float = 300.0
    heartbeat_timeout: float = 30.0
    #: Times the whole group is started again after a failed attempt (torchrun's
    #: ``--max-restarts``).
    max_restarts: int = 0


@dataclass(frozen=True)
class ClusterSpec:
    """The whole file with defaults applied, so no other module re-reads or re-checks YAML."""

    file: str
    folder: str
    controller: ControllerSpec
    command: Optional[str]
    env: dict[str, str]
    kill_grace: float
    master_port: int
    elastic: ElasticSpec
    workers: tuple[WorkerSpec, ...]
    #: Names or globs of launcher variables carried to every rank (``env_forward``).
    env_forward: tuple[str, ...] = ()
    #: Set for ``scheduler: slurm``; ``workers`` is then empty until the launch fills it in.
    slurm: Optional[SlurmSpec] = None
    #: Seconds without a frame from a host's agent after which the host is unresponsive.
    agent_timeout: float = 10.0
    #: Seconds without output or progress from any rank after which the run is hung
    #: (None: never).
    hang_timeout: Optional[float] = None
    #: The cluster key, when not derived from the file (`plan.cluster_key`): each
    #: ``fdl-fabric run`` is a cluster of its own.
    key: Optional[str] = None


# --------------------------------------------------------------------------------------------
# Environment variables
# --------------------------------------------------------------------------------------------

ENV_NAME_RE: re.Pattern[str] = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The launcher sets these per rank. Letting the file set them too would either be silently
# overwritten or, worse, win and break rank placement, so they are rejected up front.
RESERVED_ENV_KEYS: frozenset[str] = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "FLODL_HOST_NAME",
        "FDL_ENV",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_ERROR_FILE",
    }
)
_RESERVED_ENV_PREFIX = "FLODL_INTERNAL_"


def is_reserved_env_key(key: str) -> bool:
    """True for names the launcher owns; case-sensitive, like the environment itself."""
    return key in RESERVED_ENV_KEYS or key.startswith(_RESERVED_ENV_PREFIX)


# --------------------------------------------------------------------------------------------
# Small public helpers
# --------------------------------------------------------------------------------------------


def this_host_name() -> str:
    """The logical name of this machine, overridable because hostnames are often generic
    (``ubuntu``, container ids) and would not match the names used in the cluster file."""
    override = os.environ.get("FLODL_HOST_NAME", "").strip()
    return override or socket.gethostname()


_MAX_FAILURE_FORMAT = "a count like 3 or a percentage like '25%'"
_COUNT_RE = re.compile(r"[0-9]+")
_PERCENT_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*%")


def parse_max_failure(value: object) -> Union[int, float, None]:
    """Turn the user's ``max_failure`` into an int (absolute count) or a float fraction.

    The int/float distinction *is* the meaning, so a percentage always comes back as a float
    (``"100%"`` is ``1.0``, never the count ``1``) and a bare float is refused: ``0.25``
    could mean a quarter of the workers or a typo, and we cannot tell which.
    """
    if value is None:
        return None
    if isinstance(value, bool):  # bool is an int subclass; `true` is never a count
        raise ValueError(f"expected {_MAX_FAILURE_FORMAT}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        text = value.strip()
        if _COUNT_RE.fullmatch(text):
            return int(text)
        percent = _PERCENT_RE.fullmatch(text)
        if percent:
            number = float(percent.group(1))
            if number > 100:
                raise ValueError(f"a percentage must be between 0% and 100%, got {value!r}")
            return number / 100
        raise ValueError(f"expected {_MAX_FAILURE_FORMAT}, got {value!r}")
    if isinstance(value, float):
        raise ValueError(
            f"expected {_MAX_FAILURE_FORMAT}, got {value!r} "
            "(write a fraction as a percentage, e.g. '25%')"
        )
    raise ValueError(f"expected {_MAX_FAILURE_FORMAT}, got {type(value).__name__}")


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


def file_too_big(size: int, at_least: bool = False) -> str:
    """``at_least``: reading stopped early, so ``size`` is a lower bound."""
    more = "at least " if at_least else ""
    return (
        f"file is {more}{size} bytes; a cluster file may have at most {FILE_MAX_BYTES} "
        f"bytes ({FILE_MAX_BYTES >> 20} MiB)"
    )


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
    from .schema import read_cluster
    from .yamlread import NodeReader, Stop

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

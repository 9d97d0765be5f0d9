"""The cluster.yml model and its validation.

A cluster file is written by hand and read before anything is launched, so this module's job
is to turn every mistake in it into a message that points at the exact line, before an SSH
connection is opened or a GPU is touched. A bad file never half-loads: ``load_cluster``
either returns a fully resolved ``ClusterSpec`` or raises one ``ConfigError`` that lists
*every* problem found, sorted by line, so a user fixes the file in one pass instead of
playing whack-a-mole.

Why walk YAML nodes instead of ``yaml.safe_load``: the loaded dict forgets line numbers and
silently keeps the last of two duplicate keys. Composing the node tree keeps both, and we
build each scalar ourselves with PyYAML's safe constructor, so no tag can create objects.

Why bounds everywhere: the file is input, and "exit 2 with a located message" is only a
promise if reading it cannot hang or exhaust memory first. The file must be a regular file
of at most 1 MiB, YAML nesting is capped while composing (before PyYAML's recursion can
overflow), and every count or size that later code multiplies (workers, ranks, env
variables, command bytes, merged entries) is checked here, so ``load_cluster`` refuses a
file before anything downstream allocates per-rank data. The values, and why each is what it
is, live in ``limits``. Checks that cost time proportional to a value are memoized per YAML
node, because aliases let a small file mention one big value thousands of times.

Why a grammar for names and ssh options: a host name or option value is handed to DNS,
paramiko and tables verbatim, so a space, ``;`` or newline in one must be refused here, with
its line, instead of resurfacing as an unrelated failure (or a different ssh option) later.

Reading order for newcomers: the public dataclasses, then ``parse_cluster``, then the
``_read_*`` functions (one per block of the schema), then the grammar helpers, then
``_Reader`` (type checks that record problems instead of raising).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
import socket
import stat
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, TypeVar, Union

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import Event, MappingStartEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader, ReaderError
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from .limits import (
    ARG_STRLEN_MAX,
    COMMAND_MAX_BYTES,
    DEPTH_MAX,
    ENV_MAX_BYTES,
    ENV_NAME_MAX,
    ENV_VARS_MAX,
    FILE_MAX_BYTES,
    HOST_LABEL_MAX,
    HOST_NAME_MAX,
    MERGED_ENTRIES_MAX,
    NUMBER_MAX_CHARS,
    PATH_MAX_BYTES,
    PORT_MAX,
    PROBLEMS_MAX,
    RANKS_MAX,
    RANKS_PER_WORKER_MAX,
    RESTARTS_MAX,
    SECONDS_MAX,
    SSH_OPTION_MAX_BYTES,
    SSH_OPTIONS_MAX,
    USER_NAME_MAX,
    WORKERS_MAX,
)
from .shell import shell_words

__all__ = [
    "ENV_NAME_RE",
    "RESERVED_ENV_KEYS",
    "ClusterSpec",
    "ConfigError",
    "ControllerSpec",
    "ElasticSpec",
    "Problem",
    "SshSpec",
    "WorkerSpec",
    "host_name_problem",
    "is_reserved_env_key",
    "load_cluster",
    "parse_cluster",
    "parse_max_failure",
    "single_line_problem",
    "ssh_option_problem",
    "ssh_option_value_problem",
    "ssh_target_problem",
    "this_host_name",
    "user_name_problem",
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

    @property
    def ssh_target(self) -> str:
        """``host`` doubles as the ssh destination unless the file says otherwise."""
        return self.ssh.target or self.host


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
        return ConfigError([_problem(file, "", None, message)])

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
            raise refuse(_file_too_big(info.st_size))
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
        raise refuse(_file_too_big(size, at_least=True))
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        message = f"not valid UTF-8 ({exc.reason})"
        raise ConfigError([_problem(file, "", line, message)]) from None


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


def _file_too_big(size: int, at_least: bool = False) -> str:
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
    reader = _Reader(file)
    spec: Optional[ClusterSpec] = None
    try:
        root = reader.compose(text)
        spec = _read_cluster(reader, root, folder, local_hostname) if root is not None else None
    except _Stop:
        pass
    if reader.problems or spec is None:
        problems = sorted(reader.problems, key=lambda p: p.line or 0)
        if reader.stopped:
            message = f"stopped after {PROBLEMS_MAX} problems; fix these and check again"
            problems.append(_problem(file, "", None, message))
        raise ConfigError(problems)
    return spec


# --------------------------------------------------------------------------------------------
# The schema, one function per block
# --------------------------------------------------------------------------------------------

_DEFAULT_KILL_GRACE = 10.0  # seconds a rank gets to exit cleanly before it is killed
_DEFAULT_MASTER_PORT = 29500  # torch.distributed's customary port

_TOP_KEYS = ("controller", "command", "env", "env_forward", "kill_grace", "master_port",
             "elastic", "workers")
_CONTROLLER_KEYS = ("host", "port")
_ELASTIC_KEYS = ("max_failure", "formation_timeout", "heartbeat_timeout", "max_restarts")
_WORKER_KEYS = (
    "host",
    "nproc",
    "local_devices",
    "path",
    "addr",
    "nccl_socket_ifname",
    "ssh",
    "tunnel",
    "env",
    "env_forward",
    "data_path",
)
_SSH_KEYS = ("target", "user", "port", "identity_file", "options")
# Top-level keys with this prefix are ignored, so they can hold anchors for `<<` merges (the
# Docker Compose convention).
_EXTENSION_PREFIX = "x-"

_T = TypeVar("_T")


def _or(value: Optional[_T], default: _T) -> _T:
    """Absent and invalid both read as None; invalid ones are already recorded as problems
    (so the spec is discarded), which makes falling back to the default safe in both cases."""
    return default if value is None else value


def _read_cluster(
    r: _Reader, root: Node, folder: str, local_hostname: str
) -> Optional[ClusterSpec]:
    top = r.block(_Field(root, ""), _TOP_KEYS, what="a mapping at the top level", extensions=True)
    if top is None:
        return None
    controller = _read_controller(r, top.field("controller"))
    command_field = top.field("command")
    command = r.string(command_field)
    if command is not None:
        command = r.checked(command_field, command, "command", _command_problem)
    env_field = top.field("env")
    env = r.env(env_field)
    # A worker's check adds its own env to the cluster's; once the cluster env alone is too
    # big, saying so again for every worker would only bury the first message.
    rank_env = env if _check_rank_env(r, env_field, env, {}) else {}
    env_forward = _read_env_forward(r, top.field("env_forward"))
    kill_grace = r.number(top.field("kill_grace"), minimum=0.0, maximum=SECONDS_MAX)
    master_port = r.integer(top.field("master_port"), minimum=1, maximum=PORT_MAX)
    elastic = _read_elastic(r, top.field("elastic"))

    workers: list[WorkerSpec] = []
    workers_field = top.field("workers")
    items = r.sequence(workers_field)
    if workers_field.node is None:
        r.problem(workers_field, "workers is required (a list with one entry per host)", root)
    elif items == []:
        r.problem(workers_field, "must list at least one worker")
    elif items is not None and len(items) > WORKERS_MAX:
        r.problem(workers_field, f"lists {len(items)} workers; at most {WORKERS_MAX} are allowed")
        items = None
    seen_hosts: dict[str, tuple[str, int]] = {}
    for index, item in enumerate(items or []):
        field = _Field(item, f"workers[{index}]")
        worker = _read_worker(
            r, field, index, folder, local_hostname, controller, rank_env, seen_hosts
        )
        if worker is not None:
            workers.append(worker)

    # Every rank gets its own environment in the plan, so the total is what memory scales
    # with. `local_devices: all` counts 0 here: its length is only known from the host.
    ranks = sum(_ranks_of(w) for w in workers)
    if ranks > RANKS_MAX:
        r.problem(
            workers_field,
            f"the workers have {ranks} ranks in total; at most {RANKS_MAX} are allowed",
        )

    if r.problems:
        return None
    return ClusterSpec(
        file=r.file,
        folder=folder,
        controller=controller,
        command=command,
        env=env,
        kill_grace=_or(kill_grace, _DEFAULT_KILL_GRACE),
        master_port=_or(master_port, _DEFAULT_MASTER_PORT),
        elastic=elastic,
        workers=tuple(workers),
        env_forward=env_forward,
    )


def _ranks_of(worker: WorkerSpec) -> int:
    if worker.nproc is not None:
        return worker.nproc
    return len(worker.local_devices) if isinstance(worker.local_devices, tuple) else 0


def _check_rank_env(
    r: _Reader, field: _Field, cluster_env: dict[str, str], worker_env: dict[str, str]
) -> bool:
    """What one rank gets from the file (the cluster env, then its worker's) must fit in
    ``ENV_VARS_MAX`` variables and ``ENV_MAX_BYTES``: the plan copies it for every rank, and
    exec refuses an environment that does not fit in ARG_MAX. False when it does not."""
    both = " (the cluster env and this worker's env together)" if worker_env else ""
    merged = {**cluster_env, **worker_env}
    if len(merged) > ENV_VARS_MAX:
        r.problem(
            field,
            f"a rank gets {len(merged)} environment variables from the file{both}; "
            f"at most {ENV_VARS_MAX} are allowed",
        )
        return False
    size = sum(len(name) + 1 + r.utf8_size(value) for name, value in merged.items())
    if size > ENV_MAX_BYTES:
        r.problem(
            field,
            f"a rank gets {size} bytes of NAME=value strings from the file{both}; at most "
            f"{ENV_MAX_BYTES} ({ENV_MAX_BYTES >> 20} MiB, half of Linux's usual ARG_MAX)",
        )
        return False
    return True


def _read_controller(r: _Reader, field: _Field) -> ControllerSpec:
    block = r.block(field, _CONTROLLER_KEYS)
    if block is None:
        return ControllerSpec()
    default = ControllerSpec()
    return ControllerSpec(
        host=_or(r.host(block.field("host")), default.host),
        port=_or(r.integer(block.field("port"), minimum=1, maximum=PORT_MAX), default.port),
    )


def _read_elastic(r: _Reader, field: _Field) -> ElasticSpec:
    block = r.block(field, _ELASTIC_KEYS)
    if block is None:
        return ElasticSpec()
    default = ElasticSpec()
    formation = r.number(
        block.field("formation_timeout"), minimum=0.0, exclusive=True, maximum=SECONDS_MAX
    )
    heartbeat = r.number(
        block.field("heartbeat_timeout"), minimum=0.0, exclusive=True, maximum=SECONDS_MAX
    )
    restarts = r.integer(block.field("max_restarts"), minimum=0, maximum=RESTARTS_MAX)
    return ElasticSpec(
        max_failure=_read_max_failure(r, block.field("max_failure")),
        formation_timeout=_or(formation, default.formation_timeout),
        heartbeat_timeout=_or(heartbeat, default.heartbeat_timeout),
        max_restarts=_or(restarts, default.max_restarts),
    )


#: What an ``env_forward`` entry may be: a variable name, or a glob of one (``WANDB_*``).
_FORWARD_RE = re.compile(r"[A-Za-z_*?\[][A-Za-z0-9_*?\[\]!]*")


def _read_env_forward(r: _Reader, field: _Field) -> tuple[str, ...]:
    """Launcher variables to carry to the ranks: names or globs, never reserved names."""
    items = r.sequence(field, expected="a list of variable names or globs, e.g. [HF_TOKEN, "
                       "'WANDB_*']")
    if items is None:
        return ()
    if len(items) > ENV_VARS_MAX:
        r.problem(field, f"lists {len(items)} names; at most {ENV_VARS_MAX} are allowed")
        return ()
    names: list[str] = []
    for i, item in enumerate(items):
        item_field = _Field(item, f"{field.key}[{i}]")
        name = r.string(item_field)
        if name is None:
            continue
        if len(name) > ENV_NAME_MAX or not _FORWARD_RE.fullmatch(name):
            r.problem(item_field, "expected a variable name or a glob of one "
                      f"([A-Za-z_][A-Za-z0-9_]*, with * ? [...]), got {_shown(name)}")
            continue
        if not any(c in name for c in "*?[") and is_reserved_env_key(name):
            r.problem(item_field, f"{name} is set by the launcher for each rank; it cannot be "
                      "forwarded")
            continue
        names.append(name)
    return tuple(names)


def _read_max_failure(r: _Reader, field: _Field) -> Union[int, float, None]:
    if field.node is None:
        return None
    value = r.scalar(field.node)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
        # Type mistakes are described in YAML terms ("boolean true"), not Python's ("True").
        r.wrong_type(field, _MAX_FAILURE_FORMAT)
        return None
    if isinstance(value, str) and len(value) > NUMBER_MAX_CHARS:
        r.problem(field, f"expected {_MAX_FAILURE_FORMAT}, got {_describe(field.node)}")
        return None
    try:
        return parse_max_failure(value)
    except ValueError as exc:
        r.problem(field, str(exc))
        return None


def _read_worker(
    r: _Reader,
    field: _Field,
    index: int,
    folder: str,
    local_hostname: str,
    controller: ControllerSpec,
    cluster_env: dict[str, str],
    seen_hosts: dict[str, tuple[str, int]],
) -> Optional[WorkerSpec]:
    """Read one worker; returns None when it is unusable (its problems are already recorded).

    ``seen_hosts`` maps each host name to the key and line where it first appeared, so a
    duplicate can name both places.
    """
    w = r.block(field, _WORKER_KEYS, what="a mapping (one worker)")
    if w is None:
        return None

    host_field = w.field("host")
    host = r.host(host_field)
    if host_field.node is None:
        r.problem(host_field, "host is required (a unique name for this worker)", w.node)
    elif host is not None and host in seen_hosts:
        first_key, first_line = seen_hosts[host]
        message = f"duplicate host {host!r} (also {first_key} on line {first_line})"
        r.problem(host_field, message + "; each worker needs its own name")
    elif host is not None:
        seen_hosts[host] = (host_field.key, _line(host_field.node))

    nproc = r.integer(w.field("nproc"), minimum=1, maximum=RANKS_PER_WORKER_MAX)
    local_devices = _read_local_devices(r, w.field("local_devices"))
    if w.has("nproc") and w.has("local_devices"):
        r.problem(field, "set either nproc (CPU ranks) or local_devices (GPU ranks), not both")
    elif not w.has("nproc") and not w.has("local_devices"):
        r.problem(field, "set nproc (CPU ranks) or local_devices (GPU ranks)")

    # "Local" decides whether we SSH at all. The same file is launched from different
    # machines, so it is a property of (file, this machine), never of the file alone.
    is_local = host is not None and host in (local_hostname, "localhost")

    # An ssh block on a local worker is validated but unused: it matters when the same file
    # is launched from another machine, where this worker is remote.
    ssh = _read_ssh(r, w.field("ssh"), folder)

    tunnel_field = w.field("tunnel")
    tunnel = _or(r.boolean(tunnel_field), False)
    if tunnel and is_local:
        r.problem(tunnel_field, "tunnel is only for remote workers; this one runs on this machine")

    path_field = w.field("path")
    raw_path = r.path(path_field)
    if path_field.node is None and host is not None and not is_local:
        message = "path is required for a remote worker (its working directory on that host)"
        r.problem(path_field, message, w.node)
    raw_data_path = r.path(w.field("data_path"))

    addr = r.host(w.field("addr"))
    if addr is None:
        # Local ranks talk to each other the way they reach the controller. For a remote
        # worker the ssh destination is the best guess of a reachable address; a "user@"
        # prefix is an ssh detail, not part of the address.
        addr = controller.host if is_local else (ssh.target or host or "").rpartition("@")[2]

    ifname_field = w.field("nccl_socket_ifname")
    nccl_socket_ifname = r.string(ifname_field)
    if nccl_socket_ifname is not None:
        nccl_socket_ifname = r.checked(
            ifname_field, nccl_socket_ifname, "ifname", _ifname_problem
        )
    env_field = w.field("env")
    env = r.env(env_field)
    if env:
        _check_rank_env(r, env_field, cluster_env, env)
    env_forward = _read_env_forward(r, w.field("env_forward"))

    if host is None or (nproc is None and local_devices is None):
        return None
    return WorkerSpec(
        index=index,
        host=host,
        nproc=nproc,
        local_devices=local_devices,
        path=folder if raw_path is None else _resolve_path(raw_path, folder, is_local),
        addr=addr,
        nccl_socket_ifname=nccl_socket_ifname,
        ssh=ssh,
        tunnel=tunnel,
        env=env,
        data_path=None if raw_data_path is None else _resolve_path(raw_data_path, folder, is_local),
        is_local=is_local,
        line=_line(w.node),
        env_forward=env_forward,
    )


def _read_local_devices(r: _Reader, field: _Field) -> Union[tuple[int, ...], str, None]:
    if field.node is None:
        return None
    expected = 'a list of GPU indices or "all"'
    if isinstance(field.node, ScalarNode):
        value = r.scalar(field.node)
        if value == "all":
            return "all"
        if isinstance(value, str):
            r.problem(field, f"expected {expected}, got {_shown(value)}")
        else:
            r.wrong_type(field, expected)
        return None
    items = r.sequence(field, expected=expected)
    if items is None:
        return None
    if not items:
        r.problem(field, 'must list at least one GPU index (or be "all")')
        return None
    if len(items) > RANKS_PER_WORKER_MAX:
        message = f"lists {len(items)} GPUs; at most {RANKS_PER_WORKER_MAX} ranks per worker"
        r.problem(field, message)
        return None
    devices: list[int] = []
    first_seen: dict[int, str] = {}
    for i, item in enumerate(items):
        item_field = _Field(item, f"{field.key}[{i}]")
        device = r.integer(
            item_field,
            minimum=0,
            maximum=RANKS_PER_WORKER_MAX - 1,
            expected="a GPU index (an integer)",
        )
        if device is None:
            continue
        if device in first_seen:
            r.problem(item_field, f"duplicate GPU index {device} (also {first_seen[device]})")
            continue
        first_seen[device] = item_field.key
        devices.append(device)
    return tuple(devices) if len(devices) == len(items) else None


def _read_ssh(r: _Reader, field: _Field, folder: str) -> SshSpec:
    block = r.block(field, _SSH_KEYS)
    if block is None:
        return SshSpec()
    identity_file = r.path(block.field("identity_file"))
    if identity_file is not None:
        # The key is read by the local ssh client, so local rules apply even for remote hosts.
        identity_file = _resolve_path(identity_file, folder, is_local=True)
    options: list[str] = []
    options_field = block.field("options")
    items = r.sequence(options_field)
    if items is not None and len(items) > SSH_OPTIONS_MAX:
        message = f"lists {len(items)} options; at most {SSH_OPTIONS_MAX} are allowed"
        r.problem(options_field, message)
        items = None
    for i, item in enumerate(items or []):
        option_field = _Field(item, f"{options_field.key}[{i}]")
        option = r.string(option_field)
        if option is None:
            continue
        # ssh_config keywords are alphanumeric and values one line; catching "-oX=y", "X y"
        # or an embedded "\nProxyCommand ..." here beats ssh doing something else later.
        option = r.checked(option_field, option, "ssh-option", ssh_option_problem)
        if option is not None:
            options.append(option)
    target_field = block.field("target")
    target = r.string(target_field)
    if target is not None:
        target = r.checked(target_field, target, "ssh-target", ssh_target_problem)
    user_field = block.field("user")
    user = r.string(user_field)
    if user is not None:
        user = r.checked(user_field, user, "user", user_name_problem)
    return SshSpec(
        target=target,
        user=user,
        port=r.integer(block.field("port"), minimum=1, maximum=PORT_MAX),
        identity_file=identity_file,
        options=tuple(options),
    )


def _resolve_path(raw: str, folder: str, is_local: bool) -> str:
    """Anchor a path from the file so it means the same thing whatever the launch cwd is.

    ``~`` is left alone on remote workers: it names the *remote* user's home, which only the
    remote shell knows.
    """
    if raw.startswith("~"):
        if not is_local:
            return raw
        raw = os.path.expanduser(raw)
    return os.path.normpath(os.path.join(folder, raw))


# --------------------------------------------------------------------------------------------
# Grammar of names, ssh options and commands
# --------------------------------------------------------------------------------------------
#
# Each ``*_problem`` function returns None for an acceptable value, else the reason, worded to
# follow "key: " in a Problem. ``ssh`` reuses the ssh ones, so a WorkerSpec built in code
# meets the same rules as one read from a file.

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: anything that can
# end or hide a line.
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_CHAR_NAMES = {" ": "a space", "\n": "a newline", "\r": "a carriage return", "\t": "a tab"}

_HOST_GRAMMAR = "letters, digits, '-', '_' and '.' (a DNS name), or an IPv4 or IPv6 address"
_HOST_BAD_CHAR_RE = re.compile(r"[^A-Za-z0-9._-]")
_DOTTED_NUMBERS_RE = re.compile(r"[0-9.]+")
_IPV6_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_PORT_RE = re.compile(r"[0-9]{1,5}")
_SECONDS_RE = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")
_COUNT_TEXT_RE = re.compile(r"[0-9]{1,9}")
_SSH_OPTION_RE = re.compile(r" *[A-Za-z][A-Za-z0-9]* *=.*")
_STRICT_VALUES = ("yes", "no", "accept-new", "off", "ask")


def _char(c: str) -> str:
    """Name a character the way a person would look for it in an editor."""
    if c in _CHAR_NAMES:
        return _CHAR_NAMES[c]
    if c.isprintable():
        return repr(c)
    return f"the character U+{ord(c):04X} ({unicodedata.name(c, 'a control character')})"


def single_line_problem(text: str) -> Optional[str]:
    """Refuse text with a line break or another control character (values handed to ssh)."""
    bad = _CONTROL_RE.search(text)
    if bad:
        return f"contains {_char(bad.group())}; it must be a single line of printable text"
    return None


def host_name_problem(name: str) -> Optional[str]:
    """A DNS name (labels of letters, digits, '-' and '_' separated by dots, none starting or
    ending with '-', 253 characters at most) or an IPv4/IPv6 address.

    Anything else would reach DNS, ssh or a table verbatim. A label may not start with '-' so
    that no host can read as a command-line option, and names made of digits must be proper
    dotted quads because the resolver reads ``10.1`` or ``010.0.0.1`` as other addresses.
    """
    if ":" in name:
        return _ipv6_problem(name)
    if len(name) > HOST_NAME_MAX:
        return f"is {len(name)} characters long; a host name has at most {HOST_NAME_MAX}"
    bad = _HOST_BAD_CHAR_RE.search(name)
    if bad:
        return f"contains {_char(bad.group())}; a host name is {_HOST_GRAMMAR}"
    core = name[:-1] if name.endswith(".") else name  # a trailing dot: an absolute name
    for label in core.split("."):
        if not label:
            return f"{name!r} has an empty label (a leading '.' or '..')"
        if len(label) > HOST_LABEL_MAX:
            return f"has a label of {len(label)} characters; DNS allows {HOST_LABEL_MAX}"
        if label.startswith("-") or label.endswith("-"):
            return f"label {label!r} starts or ends with '-'; a host name is {_HOST_GRAMMAR}"
    if _DOTTED_NUMBERS_RE.fullmatch(core) or _inet_aton(core):
        try:
            ipaddress.IPv4Address(core)
        except ValueError:
            return (
                f"{name!r} is not a valid IPv4 address (write four numbers 0-255 without "
                "leading zeros, e.g. 10.0.0.1)"
            )
    return None


def _inet_aton(text: str) -> bool:
    """True when the C resolver would read ``text`` as an IPv4 address (``0x7f.1`` is one)."""
    try:
        socket.inet_aton(text)
    except OSError:
        return False
    return True


def _ipv6_problem(text: str) -> Optional[str]:
    if text.startswith("["):
        return f"{_shown(text)}: write an IPv6 address without brackets"
    address, percent, scope = text.partition("%")
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return f"{_shown(text)} is not a valid IPv6 address (a host name is {_HOST_GRAMMAR})"
    if percent and not _IPV6_SCOPE_RE.fullmatch(scope):
        return f"{_shown(text)} has an invalid zone (after '%': an interface name or number)"
    return None


def user_name_problem(user: str) -> Optional[str]:
    """A login name: letters, digits, '_', '.', '-' (not first), 64 characters at most.

    Other names (``DOMAIN\\user``) can still be set as ``User`` in ~/.ssh/config.
    """
    if len(user) > USER_NAME_MAX:
        return f"is {len(user)} characters long; a user name has at most {USER_NAME_MAX}"
    if not _USER_RE.fullmatch(user):
        return (
            f"{_shown(user)} is not a user name (letters, digits, '_', '.' and '-', "
            "not starting with '-' or '.')"
        )
    return None


def ssh_target_problem(target: str) -> Optional[str]:
    """``host`` or ``user@host``, as ssh takes it (the last '@' separates the user)."""
    user, at, host = target.rpartition("@")
    if at:
        problem = user_name_problem(user)
        if problem:
            return f"user part {problem}"
    return host_name_problem(host)


def _port_problem(text: str) -> Optional[str]:
    if _PORT_RE.fullmatch(text) and 1 <= int(text) <= PORT_MAX:
        return None
    return f"must be a port number between 1 and {PORT_MAX}"


def _seconds_problem(text: str) -> Optional[str]:
    if _SECONDS_RE.fullmatch(text) and float(text) <= SECONDS_MAX:
        return None
    return f"must be a number of seconds between 0 and {SECONDS_MAX}"


def _count_problem(text: str) -> Optional[str]:
    return None if _COUNT_TEXT_RE.fullmatch(text) else "must be a whole number >= 0"


def _strict_problem(text: str) -> Optional[str]:
    if text.lower() in _STRICT_VALUES:
        return None
    return "must be one of yes, no, accept-new"


def _file_option_problem(text: str) -> Optional[str]:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > PATH_MAX_BYTES:
        return f"is {size} bytes long; a path has at most {PATH_MAX_BYTES} (PATH_MAX)"
    return None


def _proxy_jump_problem(text: str) -> Optional[str]:
    """``none`` or comma-separated ``[user@]host[:port]`` hops, as ``ssh.make_connection``
    splits them (so an IPv6 jump host, which needs brackets, is not accepted)."""
    if text == "none":
        return None
    for hop in text.split(","):
        hop = hop.strip()
        if not hop:
            return "has an empty jump host (write [user@]host[:port], separated by commas)"
        user, at, host_port = hop.rpartition("@")
        host, colon, port = host_port.partition(":")
        if at:
            problem = user_name_problem(user)
            if problem:
                return f"jump host {_shown(hop)}: user part {problem}"
        if ":" in port:
            return (
                f"jump host {_shown(hop)}: IPv6 jump hosts are not supported; name it in "
                "~/.ssh/config"
            )
        problem = host_name_problem(host) or (_port_problem(port) if colon else None)
        if problem:
            return f"jump host {_shown(hop)}: {problem}"
    return None


# Values the launcher interprets, by lowercase option name. Which names are supported at all
# is decided in ``ssh`` (an unknown one is refused there, still before anything starts).
_SSH_VALUE_RULES: dict[str, Callable[[str], Optional[str]]] = {
    "port": _port_problem,
    "hostname": host_name_problem,
    "user": user_name_problem,
    "proxyjump": _proxy_jump_problem,
    "connecttimeout": _seconds_problem,
    "serveraliveinterval": _seconds_problem,
    "serveralivecountmax": _count_problem,
    "stricthostkeychecking": _strict_problem,
    "identityfile": _file_option_problem,
    "userknownhostsfile": _file_option_problem,
}


def ssh_option_value_problem(key: str, value: str) -> Optional[str]:
    """Why ``key=value`` (both stripped) is not a usable value for that option, or None."""
    problem = single_line_problem(value)
    if problem is None and not value:
        problem = "has no value"
    if problem is None:
        rule = _SSH_VALUE_RULES.get(key.lower())
        problem = rule(value) if rule else None
    return None if problem is None else f"{key}={_shown(value)}: {problem}"


def ssh_option_problem(option: str) -> Optional[str]:
    """An ``ssh.options`` entry: one line, ``Key=Value``, and a value its option can take."""
    size = len(option.encode("utf-8", "surrogatepass"))
    if size > SSH_OPTION_MAX_BYTES:
        return f"is {size} bytes long; an ssh option has at most {SSH_OPTION_MAX_BYTES}"
    problem = single_line_problem(option)
    if problem:
        return problem
    if not _SSH_OPTION_RE.fullmatch(option):
        return (
            "expected 'Key=Value' (an ssh -o option, e.g. 'StrictHostKeyChecking=accept-new'), "
            f"got {_shown(option)}"
        )
    key, _, value = option.partition("=")
    return ssh_option_value_problem(key.strip(), value.strip())


def _command_problem(command: str) -> Optional[str]:
    """The command must split into words (as the launcher will split it) that exec can take:
    no NUL, at most ``COMMAND_MAX_BYTES`` in all, and no word over MAX_ARG_STRLEN."""
    size = len(command.encode("utf-8", "surrogatepass"))
    if size > COMMAND_MAX_BYTES:
        return (
            f"is {size} bytes long; a command has at most {COMMAND_MAX_BYTES} "
            f"({COMMAND_MAX_BYTES >> 10} KiB)"
        )
    if "\0" in command:
        return "contains a NUL character, which no program argument can hold"
    try:
        words = shell_words(command)
    except ValueError as exc:  # e.g. an unbalanced quote: fail now, not on every host
        return f"cannot be split into shell words: {exc}"
    for number, word in enumerate(words, 1):
        word_size = len(word.encode("utf-8", "surrogatepass"))
        if word_size > ARG_STRLEN_MAX:
            return (
                f"word {number} is {word_size} bytes long; Linux limits one program argument "
                f"to {ARG_STRLEN_MAX} bytes (MAX_ARG_STRLEN)"
            )
    return None


def _path_problem(path: str) -> Optional[str]:
    if "\0" in path:
        return "contains a NUL character, which no path can hold"
    if "\n" in path or "\r" in path:
        return "contains a line break; a path must be a single line"
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > PATH_MAX_BYTES:
        return f"is {size} bytes long; a path has at most {PATH_MAX_BYTES} (PATH_MAX)"
    return None


def _ifname_problem(ifname: str) -> Optional[str]:
    """Exported as NCCL_SOCKET_IFNAME: one line, and it must fit in one env string."""
    size = len("NCCL_SOCKET_IFNAME=") + len(ifname.encode("utf-8", "surrogatepass"))
    if size > ARG_STRLEN_MAX:
        return f"is too long for an environment variable ({size} bytes; at most {ARG_STRLEN_MAX})"
    return single_line_problem(ifname)


# --------------------------------------------------------------------------------------------
# Reading YAML nodes while collecting problems
# --------------------------------------------------------------------------------------------

_TAG = "tag:yaml.org,2002:"
_KIND_BY_TAG = {
    _TAG + "str": "string",
    _TAG + "int": "integer",
    _TAG + "float": "float",
    _TAG + "bool": "boolean",
    _TAG + "null": "null",
    _TAG + "timestamp": "timestamp",
    _TAG + "binary": "binary",
    _TAG + "map": "a mapping",
    _TAG + "seq": "a list",
}
_SCALAR_TAGS = frozenset(tag for tag in _KIND_BY_TAG if tag not in (_TAG + "map", _TAG + "seq"))
_NUMBER_TAGS = frozenset({_TAG + "int", _TAG + "float"})
_MERGE_TAG = _TAG + "merge"
_INVALID = object()  # a scalar we refuse to construct (unknown tag or bad explicit tag)

# A float as YAML 1.2 writes it. PyYAML implements YAML 1.1, whose floats need a '.' and a
# signed exponent, so `1.0e9` and `1e9` load as strings; for an integer or number setting
# they are read (or at least described) as the floats the user meant.
_YAML12_FLOAT_RE = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")

# PyYAML's own rule (yaml.reader.Reader.NON_PRINTABLE), checked up front so that the message
# and line are the same whichever parser runs.
_NON_PRINTABLE_RE = re.compile(
    "[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
)

_SHOWN_MAX = 60  # characters of a user's value quoted in a message
_KEY_MAX = 200  # characters of a key path in a message
_MESSAGE_MAX = 600  # characters of a message; a last resort, the parts are shortened first


def _shown(value: str) -> str:
    """repr() of a user's value, shortened: messages must stay readable (and small) even for
    a value of a megabyte."""
    if len(value) <= _SHOWN_MAX:
        return repr(value)
    return f"{value[:_SHOWN_MAX]!r}... ({len(value)} characters)"


def _clip(text: str, limit: int) -> str:
    """Shorten a finished message or key, and make it printable: a lone surrogate (from a
    ``"\\ud800"`` escape or a file name that is not UTF-8) would break printing it."""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if _SURROGATE_RE.search(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _problem(file: str, key: str, line: Optional[int], message: str) -> Problem:
    return Problem(_clip(file, 4096), _clip(key, _KEY_MAX), line, _clip(message, _MESSAGE_MAX))


class _Field(NamedTuple):
    """A value node (None when the key is absent) and the key path used to report it."""

    node: Optional[Node]
    key: str


_PLAIN_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*|<<")


@dataclass
class _Block:
    """A mapping whose keys were checked; gives each entry its key path."""

    node: MappingNode
    path: str
    entries: dict[str, tuple[Node, Node]]  # key text -> (key node, value node)
    bracket_keys: bool = False  # env["A B"] rather than env.A B: env names can be anything

    def has(self, name: str) -> bool:
        return name in self.entries

    def key(self, name: str) -> str:
        """The key path of an entry; a name that is not a plain word is shown quoted, so a
        key holding a newline or a dot cannot break or fake the path."""
        if self.bracket_keys or not _PLAIN_KEY_RE.fullmatch(name):
            return f"{self.path}[{json.dumps(_clip(name, _SHOWN_MAX), ensure_ascii=False)}]"
        name = _clip(name, _SHOWN_MAX)
        return f"{self.path}.{name}" if self.path else name

    def field(self, name: str) -> _Field:
        entry = self.entries.get(name)
        return _Field(entry[1] if entry else None, self.key(name))


def _line(node: Node) -> int:
    return int(node.start_mark.line) + 1


def _is_plain(node: ScalarNode) -> bool:
    return not node.style  # None from PyYAML's parser, '' from libyaml's


def _looks_like_float(node: Node) -> bool:
    """A plain string scalar that YAML 1.2 (and the user) would call a float."""
    return (
        isinstance(node, ScalarNode)
        and node.tag == _TAG + "str"
        and _is_plain(node)
        and len(node.value) <= NUMBER_MAX_CHARS
        and _YAML12_FLOAT_RE.fullmatch(node.value) is not None
    )


def _describe(node: Node) -> str:
    """Name a node the way the user wrote it ("string 'two'", "boolean yes"), in YAML terms."""
    kind = _KIND_BY_TAG.get(node.tag)
    if kind is None:
        return f"a value tagged {_shown(node.tag)}"
    if not isinstance(node, ScalarNode) or kind == "null":
        return kind
    if _looks_like_float(node):
        return f"float {node.value}"
    if kind == "string":
        return f"string {_shown(node.value)}"
    if len(node.value) > _SHOWN_MAX:
        return f"{kind} {node.value[:_SHOWN_MAX]}... ({len(node.value)} characters)"
    return f"{kind} {node.value}"


class _Stop(Exception):
    """PROBLEMS_MAX problems are recorded: stop reading (aliases can repeat one broken
    mapping thousands of times, and nobody reads past the first screens anyway)."""


class _TooDeep(Exception):
    """Collections nested deeper than DEPTH_MAX, raised while composing."""

    def __init__(self, key: str, line: int) -> None:
        super().__init__(key, line)
        self.key = key
        self.line = line


class _BoundedComposer(Composer):
    """PyYAML's composer, refusing to nest deeper than ``DEPTH_MAX`` collections.

    The composer recurses once per level (a few Python frames each), so a 5000-deep ``[[[``
    file would end in RecursionError; here it stops at the first level too many, and knows
    the key path to report. Nodes keep only their start mark (all we report), which saves a
    third of the memory of a large file.
    """

    peek_event: Callable[[], Event]  # provided by the parser half of the loader

    def __init__(self) -> None:
        Composer.__init__(self)
        self._path: list[str] = []
        self._collections = 0

    def compose_node(self, parent: Optional[Node], index: Any) -> Optional[Node]:
        self._path.append(_path_part(parent, index))
        try:
            opens = isinstance(self.peek_event(), (SequenceStartEvent, MappingStartEvent))
            if opens:
                if self._collections >= DEPTH_MAX:
                    mark = self.peek_event().start_mark
                    line = 0 if mark is None else int(mark.line) + 1
                    raise _TooDeep("".join(self._path).lstrip("."), line)
                self._collections += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                if opens:
                    self._collections -= 1
        finally:
            self._path.pop()
        if node is not None:
            node.end_mark = node.start_mark
        return node


def _path_part(parent: Optional[Node], index: object) -> str:
    """The key-path piece of a node being composed, as Problem keys write it."""
    if parent is None:
        return ""
    if isinstance(index, int):
        return f"[{index}]"
    if isinstance(index, ScalarNode):
        return f".{_clip(str(index.value), _SHOWN_MAX)}"
    return ".?"  # a mapping key, or a value under a non-scalar key


class _PyLoader(Reader, Scanner, Parser, _BoundedComposer, Resolver):
    """Pure-Python parsing; used when PyYAML was built without libyaml."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self)
        Resolver.__init__(self)


def _make_loader() -> Callable[[str], _BoundedComposer]:
    """libyaml's parser under our composer when available: about 6x faster on a 1 MiB file,
    with the same nodes, marks and tag resolution (the composer and resolver are Python)."""
    try:
        from yaml._yaml import CParser
    except ImportError:  # PyYAML without libyaml
        return _PyLoader

    class _CLoader(_BoundedComposer, CParser, Resolver):  # type: ignore[misc]
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            _BoundedComposer.__init__(self)
            Resolver.__init__(self)

    return _CLoader


_Loader = _make_loader()


class _Reader:
    """Type-checked access to YAML nodes that records problems instead of raising.

    Every reader returns None for an absent *or* invalid value, so callers can carry on and
    find the next problem; ``parse_cluster`` raises once at the end if anything was recorded.
    Aliases make one node reachable from many places, so whatever costs time in proportion
    to a value is memoized per node: checks (``checked``), byte sizes, and merged mappings.
    """

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.stopped = False
        self._constructor = SafeConstructor()
        self._verdicts: dict[tuple[int, str], Optional[str]] = {}
        self._sizes: dict[int, tuple[str, int]] = {}
        self._flattened: dict[int, dict[str, tuple[Node, Node]]] = {}
        self._flattening: set[int] = set()
        self._merge_budget = MERGED_ENTRIES_MAX

    def add(self, problem: Problem) -> None:
        if len(self.problems) >= PROBLEMS_MAX:
            self.stopped = True
            raise _Stop
        self.problems.append(problem)

    def problem(self, field: _Field, message: str, at: Optional[Node] = None) -> None:
        """Record a problem at ``at`` (default: the field's own node)."""
        node = at if at is not None else field.node
        self.add(_problem(self.file, field.key, None if node is None else _line(node), message))

    def wrong_type(self, field: _Field, expected: str, hint: str = "") -> None:
        found = "nothing" if field.node is None else _describe(field.node)
        self.problem(field, f"expected {expected}, got {found}{hint}")

    def compose(self, text: str) -> Optional[Node]:
        """Parse without constructing anything; a syntax error becomes a located problem."""
        if len(text) > FILE_MAX_BYTES:  # characters: a cheap first test, bytes come next
            self.add(_problem(self.file, "", None, _file_too_big(len(text), at_least=True)))
            return None
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            line = text.count("\n", 0, exc.start) + 1
            message = f"not valid Unicode (a lone surrogate U+{ord(text[exc.start]):04X})"
            self.add(_problem(self.file, "", line, message))
            return None
        if size > FILE_MAX_BYTES:
            self.add(_problem(self.file, "", None, _file_too_big(size)))
            return None
        bad = _NON_PRINTABLE_RE.search(text)
        if bad:
            line = text.count("\n", 0, bad.start()) + 1
            message = (
                f"invalid YAML: unacceptable character #x{ord(bad.group()):04x}: "
                "special characters are not allowed"
            )
            self.add(_problem(self.file, "", line, message))
            return None
        try:
            root = _Loader(text).get_single_node()
        except _TooDeep as exc:
            message = f"nested more than {DEPTH_MAX} levels deep (lists and mappings)"
            self.add(_problem(self.file, exc.key, exc.line, message))
            return None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            # PyYAML splits its sentences: "while scanning a simple key" + "could not find..."
            reason = ", ".join(part for part in (exc.context, exc.problem) if part)
            where = None if mark is None else int(mark.line) + 1
            self.add(_problem(self.file, "", where, f"invalid YAML: {reason}"))
            return None
        except ReaderError as exc:  # not expected after the check above; kept as a net
            reason = str(exc).splitlines()[0]  # the rest names "<unicode string>", not the file
            self.add(_problem(self.file, "", None, f"invalid YAML: {reason}"))
            return None
        if root is None:
            self.add(
                _problem(self.file, "", None, "file is empty (expected a mapping with 'workers')")
            )
        return root

    def scalar(self, node: Node) -> object:
        """The Python value of a plain scalar, or ``_INVALID`` for anything else.

        Only the standard scalar tags are constructed, which is what keeps loading safe, and
        numbers only up to ``NUMBER_MAX_CHARS`` (YAML 1.1's ``1:2:3`` form is quadratic).
        """
        if not isinstance(node, ScalarNode) or node.tag not in _SCALAR_TAGS:
            return _INVALID
        if node.tag in _NUMBER_TAGS and len(node.value) > NUMBER_MAX_CHARS:
            return _INVALID
        try:
            return self._constructor.construct_object(node)
        except (yaml.YAMLError, ValueError, KeyError, OverflowError):  # e.g. "!!int abc"
            return _INVALID

    def checked(
        self, field: _Field, value: str, kind: str, check: Callable[[str], Optional[str]]
    ) -> Optional[str]:
        """``value`` if ``check`` finds no problem in it, else None with the problem recorded.

        The verdict is memoized per node, because an alias can bring one long value into
        every worker.
        """
        assert field.node is not None
        key = (id(field.node), kind)
        if key not in self._verdicts:
            self._verdicts[key] = check(value)
        problem = self._verdicts[key]
        if problem is None:
            return value
        self.problem(field, problem)
        return None

    def utf8_size(self, value: str) -> int:
        """Bytes of ``value`` in UTF-8, memoized per string object (values are shared by all
        the workers an alias brings them to). The entry keeps ``value`` alive, so its id
        cannot be reused for another string."""
        known = self._sizes.get(id(value))
        if known is not None:
            return known[1]
        size = len(value.encode("utf-8", "surrogatepass"))
        self._sizes[id(value)] = (value, size)
        return size

    # Mappings, with merge keys -------------------------------------------------------------

    def mapping(
        self,
        field: _Field,
        what: str = "a mapping",
        bracket_keys: bool = False,
        max_entries: Optional[int] = None,
    ) -> Optional[_Block]:
        """Entries of a mapping by key *text*, merges applied; reports duplicate, non-scalar
        and (with ``max_entries``) too many keys.

        Keys are taken as written rather than as YAML 1.1 values, so an env var named ``NO``
        or ``ON`` stays a name instead of becoming the boolean False/True.
        """
        node = field.node
        if node is None:
            return None
        if not isinstance(node, MappingNode) or node.tag != _TAG + "map":
            self.wrong_type(field, what)
            return None
        if max_entries is not None and len(node.value) > max_entries + 1:  # +1: a '<<'
            self.problem(field, f"has {len(node.value)} entries; at most {max_entries}")
            return None
        block = _Block(node, field.key, {}, bracket_keys)
        entries = self._flatten(node, block)
        if max_entries is not None and len(entries) > max_entries:
            self.problem(field, f"has {len(entries)} entries; at most {max_entries}")
            return None
        block.entries = dict(entries)
        return block

    def _flatten(self, node: MappingNode, block: _Block) -> dict[str, tuple[Node, Node]]:
        """The entries of ``node`` with its ``<<`` merges applied, computed once per node.

        As in YAML's merge key type, keys written in the mapping beat merged ones, and an
        earlier mapping in ``<<: [*a, *b]`` beats a later one; merged entries keep the lines
        where they are written. Problems name the key path of the mapping being read.
        """
        known = self._flattened.get(id(node))
        if known is not None:
            return known
        if id(node) in self._flattening:
            self.problem(_Field(node, block.key("<<")), "a merge includes itself", node)
            return {}
        if len(self._flattening) >= DEPTH_MAX:
            message = f"merges are nested more than {DEPTH_MAX} levels deep"
            self.problem(_Field(node, block.key("<<")), message, node)
            return {}
        self._flattening.add(id(node))
        try:
            entries = self._entries(node, block)
        finally:
            self._flattening.discard(id(node))
        self._flattened[id(node)] = entries
        return entries

    def _entries(self, node: MappingNode, block: _Block) -> dict[str, tuple[Node, Node]]:
        written: dict[str, tuple[Node, Node]] = {}
        merge: Optional[tuple[Node, Node]] = None
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                message = f"keys must be names, got {_describe(key_node)}"
                self.problem(_Field(node, block.path), message, key_node)
                continue
            if key_node.tag == _MERGE_TAG:
                if merge is not None:
                    first_line = _line(merge[0])
                    message = f"duplicate merge key '<<' (first on line {first_line})"
                    self.problem(_Field(key_node, block.key("<<")), message)
                    continue
                merge = (key_node, value_node)
                continue
            name = str(key_node.value)
            if name in written:
                first_line = _line(written[name][0])
                self.problem(
                    _Field(key_node, block.key(name)),
                    f"duplicate key {_shown(name)} (first on line {first_line})",
                )
                continue
            written[name] = (key_node, value_node)
        if merge is None:
            return written
        merged: dict[str, tuple[Node, Node]] = {}
        merge_field = _Field(merge[1], block.key("<<"))
        for source in self._merge_sources(merge_field):
            for name, entry in self._flatten(source, block).items():
                if not self._spend(merge_field):
                    return {**merged, **written}
                merged.setdefault(name, entry)
        merged.update(written)
        return merged

    def _merge_sources(self, field: _Field) -> Iterator[MappingNode]:
        expected = "a mapping or a list of mappings to merge (e.g. <<: *defaults)"
        node = field.node
        if isinstance(node, MappingNode) and node.tag == _TAG + "map":
            yield node
            return
        if not isinstance(node, SequenceNode) or node.tag != _TAG + "seq":
            self.wrong_type(field, expected)
            return
        for i, item in enumerate(node.value):
            if not isinstance(item, MappingNode) or item.tag != _TAG + "map":
                self.wrong_type(_Field(item, f"{field.key}[{i}]"), "a mapping to merge")
                continue
            if not self._spend(field):
                return
            yield item

    def _spend(self, field: _Field) -> bool:
        """Count one merged entry (or source) against MERGED_ENTRIES_MAX for the file."""
        self._merge_budget -= 1
        if self._merge_budget >= 0:
            return True
        if self._merge_budget == -1:  # report once, at the merge that ran out
            message = f"merge keys copy more than {MERGED_ENTRIES_MAX} entries in this file"
            self.problem(field, message)
        return False

    def block(
        self,
        field: _Field,
        allowed: tuple[str, ...],
        what: str = "a mapping",
        extensions: bool = False,
    ) -> Optional[_Block]:
        """A mapping with a fixed set of keys; unknown keys are reported with a suggestion.

        With ``extensions``, keys starting with ``x-`` are accepted and ignored.
        """
        block = self.mapping(field, what)
        if block is None:
            return None
        for name, (key_node, _) in list(block.entries.items()):
            if name in allowed:
                continue
            if not (extensions and name.startswith(_EXTENSION_PREFIX)):
                message = f"unknown key {_shown(name)}"
                close = difflib.get_close_matches(name[:_SHOWN_MAX], allowed, n=1)
                if close:
                    message += f" (did you mean {close[0]!r}?)"
                self.problem(_Field(key_node, block.key(name)), message)
            del block.entries[name]
        return block

    # Scalars and lists ---------------------------------------------------------------------

    def sequence(self, field: _Field, expected: str = "a list") -> Optional[list[Node]]:
        node = field.node
        if node is None:
            return None
        if not isinstance(node, SequenceNode) or node.tag != _TAG + "seq":
            self.wrong_type(field, expected)
            return None
        return list(node.value)

    def string(self, field: _Field) -> Optional[str]:
        """A non-blank string: every string setting except env values names something."""
        if field.node is None:
            return None
        value = self.scalar(field.node)
        if not isinstance(value, str):
            # `path: ~` is YAML for null, which is almost certainly not what was meant.
            tilde = isinstance(field.node, ScalarNode) and field.node.value == "~"
            self.wrong_type(field, "a string", " (to mean '~', quote it: '~')" if tilde else "")
            return None
        if not value or value.isspace():
            self.problem(field, "must not be empty")
            return None
        return self.checked(field, value, "unicode", _unicode_problem)

    def host(self, field: _Field) -> Optional[str]:
        """A host name or IP address (see ``host_name_problem``)."""
        value = self.string(field)
        return None if value is None else self.checked(field, value, "host", host_name_problem)

    def path(self, field: _Field) -> Optional[str]:
        """A file system path: one line, no NUL, at most PATH_MAX bytes."""
        value = self.string(field)
        return None if value is None else self.checked(field, value, "path", _path_problem)

    def boolean(self, field: _Field) -> Optional[bool]:
        if field.node is None:
            return None
        value = self.scalar(field.node)
        if not isinstance(value, bool):
            self.wrong_type(field, "a boolean (true or false)")
            return None
        return value

    def _number_too_long(self, field: _Field) -> bool:
        node = field.node
        if (
            isinstance(node, ScalarNode)
            and node.tag in _NUMBER_TAGS
            and len(node.value) > NUMBER_MAX_CHARS
        ):
            message = (
                f"is a number of {len(node.value)} characters; at most {NUMBER_MAX_CHARS} "
                "are read"
            )
            self.problem(field, message)
            return True
        return False

    def integer(
        self,
        field: _Field,
        *,
        minimum: int,
        maximum: Optional[int] = None,
        expected: str = "an integer",
    ) -> Optional[int]:
        if field.node is None or self._number_too_long(field):
            return None
        value = self.scalar(field.node)
        if isinstance(value, bool) or not isinstance(value, int):
            self.wrong_type(field, expected)
            return None
        if maximum is not None and not minimum <= value <= maximum:
            self.problem(field, f"must be between {minimum} and {maximum}, got {value}")
            return None
        if value < minimum:
            self.problem(field, f"must be >= {minimum}, got {value}")
            return None
        return value

    def number(
        self,
        field: _Field,
        *,
        minimum: float,
        exclusive: bool = False,
        maximum: Optional[float] = None,
    ) -> Optional[float]:
        """A finite int or float; ``exclusive`` makes ``minimum`` itself invalid."""
        if field.node is None or self._number_too_long(field):
            return None
        value = self.scalar(field.node)
        if _looks_like_float(field.node):
            value = float(str(value))  # `1e3` is a string to YAML 1.1, a float to the user
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.wrong_type(field, "a number")
            return None
        number = float(value)
        if not math.isfinite(number):
            self.problem(field, f"must be a finite number, got {field.node.value}")
            return None
        if number < minimum or (exclusive and number == minimum):
            bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
            self.problem(field, f"must be {bound}, got {field.node.value}")
            return None
        if maximum is not None and number > maximum:
            self.problem(field, f"must be at most {maximum:g}, got {field.node.value}")
            return None
        return number

    def env(self, field: _Field) -> dict[str, str]:
        """Environment variables, checked so that every entry can really be exported."""
        block = self.mapping(field, bracket_keys=True, max_entries=ENV_VARS_MAX)
        if block is None:
            return {}
        env: dict[str, str] = {}
        for name, (key_node, value_node) in block.entries.items():
            entry = block.key(name)
            if not ENV_NAME_RE.fullmatch(name):
                self.problem(
                    _Field(key_node, entry),
                    "not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                )
                continue
            if len(name) > ENV_NAME_MAX:
                message = f"name is {len(name)} characters long; at most {ENV_NAME_MAX}"
                self.problem(_Field(key_node, entry), message)
                continue
            if is_reserved_env_key(name):
                self.problem(
                    _Field(key_node, entry),
                    "is reserved (set by the launcher for each rank); "
                    "GPU pinning belongs in local_devices",
                )
                continue
            value_field = _Field(value_node, entry)
            value = self.scalar(value_node)
            if not isinstance(value, str):
                self.problem(value_field, _env_type_message(value_node))
                continue
            size = len(name) + 1 + self.utf8_size(value)
            if size > ARG_STRLEN_MAX:
                self.problem(
                    value_field,
                    f"{name}=value is {size} bytes long; Linux limits one environment string "
                    f"to {ARG_STRLEN_MAX} bytes (MAX_ARG_STRLEN)",
                )
                continue
            if self.checked(value_field, value, "env-value", _env_value_problem) is None:
                continue
            env[name] = value
        return env


def _unicode_problem(text: str) -> Optional[str]:
    bad = _SURROGATE_RE.search(text)
    if bad:
        return f"contains a lone surrogate U+{ord(bad.group()):04X}, which is not valid Unicode"
    return None


def _env_value_problem(value: str) -> Optional[str]:
    if "\0" in value:
        return "value contains a NUL character (not allowed in env)"
    return _unicode_problem(value)


def _env_type_message(node: Node) -> str:
    """Explain a non-string env value and how to write it, since `N: 8` is an easy slip."""
    message = f"value must be a string, got {_describe(node)}"
    if not isinstance(node, ScalarNode):
        return message
    if node.tag == _TAG + "null":
        return message + ' (write "" for an empty value)'
    if len(node.value) > _SHOWN_MAX:
        return message + " (quote it in YAML)"
    return message + f" (quote it in YAML: {json.dumps(node.value, ensure_ascii=False)})"

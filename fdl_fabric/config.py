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

Reading order for newcomers: the public dataclasses, then ``parse_cluster``, then the
``_read_*`` functions (one per block of the schema), then ``_Reader`` (type checks that
record problems instead of raising).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import shlex
import socket
from dataclasses import dataclass
from typing import NamedTuple, Optional, TypeVar, Union

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError

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
        "MASTER_ADDR",
        "MASTER_PORT",
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
    """Read and validate a cluster file; relative paths inside it are relative to its folder."""
    file = os.fspath(path)
    try:
        with open(file, encoding="utf-8") as stream:
            text = stream.read()
    except FileNotFoundError:
        raise ConfigError([Problem(file, "", None, "file not found")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(file, "", None, f"not valid UTF-8 ({exc.reason})")]) from None
    except OSError as exc:
        raise ConfigError([Problem(file, "", None, f"cannot read: {exc.strerror}")]) from None
    folder = os.path.dirname(os.path.abspath(file))
    return parse_cluster(text, file=file, folder=folder, local_hostname=local_hostname)


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
    root = reader.compose(text)
    spec = _read_cluster(reader, root, folder, local_hostname) if root is not None else None
    if reader.problems or spec is None:
        raise ConfigError(sorted(reader.problems, key=lambda p: p.line or 0))
    return spec


# --------------------------------------------------------------------------------------------
# The schema, one function per block
# --------------------------------------------------------------------------------------------

_DEFAULT_KILL_GRACE = 10.0  # seconds a rank gets to exit cleanly before it is killed
_DEFAULT_MASTER_PORT = 29500  # torch.distributed's customary port

_TOP_KEYS = ("controller", "command", "env", "kill_grace", "master_port", "elastic", "workers")
_CONTROLLER_KEYS = ("host", "port")
_ELASTIC_KEYS = ("max_failure", "formation_timeout", "heartbeat_timeout")
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
    "data_path",
)
_SSH_KEYS = ("target", "user", "port", "identity_file", "options")
_SSH_OPTION_RE = re.compile(r"\s*[A-Za-z][A-Za-z0-9]*\s*=.*", re.DOTALL)

_T = TypeVar("_T")


def _or(value: Optional[_T], default: _T) -> _T:
    """Absent and invalid both read as None; invalid ones are already recorded as problems
    (so the spec is discarded), which makes falling back to the default safe in both cases."""
    return default if value is None else value


def _read_cluster(
    r: _Reader, root: Node, folder: str, local_hostname: str
) -> Optional[ClusterSpec]:
    top = r.block(_Field(root, ""), _TOP_KEYS, what="a mapping at the top level")
    if top is None:
        return None
    controller = _read_controller(r, top.field("controller"))
    command = r.string(top.field("command"))
    if command is not None:
        try:
            shlex.split(command)
        except ValueError as exc:  # e.g. an unbalanced quote: fail now, not on every host
            r.problem(top.field("command"), f"cannot be split into shell words: {exc}")
    env = r.env(top.field("env"))
    kill_grace = r.number(top.field("kill_grace"), minimum=0.0)
    master_port = r.integer(top.field("master_port"), minimum=1, maximum=65535)
    elastic = _read_elastic(r, top.field("elastic"))

    workers: list[WorkerSpec] = []
    workers_field = top.field("workers")
    items = r.sequence(workers_field)
    if workers_field.node is None:
        r.problem(workers_field, "workers is required (a list with one entry per host)", root)
    elif items == []:
        r.problem(workers_field, "must list at least one worker")
    seen_hosts: dict[str, tuple[str, int]] = {}
    for index, item in enumerate(items or []):
        field = _Field(item, f"workers[{index}]")
        worker = _read_worker(r, field, index, folder, local_hostname, controller, seen_hosts)
        if worker is not None:
            workers.append(worker)

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
    )


def _read_controller(r: _Reader, field: _Field) -> ControllerSpec:
    block = r.block(field, _CONTROLLER_KEYS)
    if block is None:
        return ControllerSpec()
    default = ControllerSpec()
    return ControllerSpec(
        host=_or(r.string(block.field("host")), default.host),
        port=_or(r.integer(block.field("port"), minimum=1, maximum=65535), default.port),
    )


def _read_elastic(r: _Reader, field: _Field) -> ElasticSpec:
    block = r.block(field, _ELASTIC_KEYS)
    if block is None:
        return ElasticSpec()
    default = ElasticSpec()
    formation = r.number(block.field("formation_timeout"), minimum=0.0, exclusive=True)
    heartbeat = r.number(block.field("heartbeat_timeout"), minimum=0.0, exclusive=True)
    return ElasticSpec(
        max_failure=_read_max_failure(r, block.field("max_failure")),
        formation_timeout=_or(formation, default.formation_timeout),
        heartbeat_timeout=_or(heartbeat, default.heartbeat_timeout),
    )


def _read_max_failure(r: _Reader, field: _Field) -> Union[int, float, None]:
    if field.node is None:
        return None
    value = r.scalar(field.node)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
        # Type mistakes are described in YAML terms ("boolean true"), not Python's ("True").
        r.wrong_type(field, _MAX_FAILURE_FORMAT)
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
    host = r.string(host_field)
    if host_field.node is None:
        r.problem(host_field, "host is required (a unique name for this worker)", w.node)
    elif host is not None and host in seen_hosts:
        first_key, first_line = seen_hosts[host]
        message = f"duplicate host {host!r} (also {first_key} on line {first_line})"
        r.problem(host_field, message + "; each worker needs its own name")
    elif host is not None:
        seen_hosts[host] = (host_field.key, _line(host_field.node))

    nproc = r.integer(w.field("nproc"), minimum=1)
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
    raw_path = r.string(path_field)
    if path_field.node is None and host is not None and not is_local:
        message = "path is required for a remote worker (its working directory on that host)"
        r.problem(path_field, message, w.node)
    raw_data_path = r.string(w.field("data_path"))

    addr = r.string(w.field("addr"))
    if addr is None:
        # Local ranks talk to each other the way they reach the controller. For a remote
        # worker the ssh destination is the best guess of a reachable address; a "user@"
        # prefix is an ssh detail, not part of the address.
        addr = controller.host if is_local else (ssh.target or host or "").rpartition("@")[2]

    nccl_socket_ifname = r.string(w.field("nccl_socket_ifname"))
    env = r.env(w.field("env"))

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
            r.problem(field, f"expected {expected}, got {value!r}")
        else:
            r.wrong_type(field, expected)
        return None
    items = r.sequence(field, expected=expected)
    if items is None:
        return None
    if not items:
        r.problem(field, 'must list at least one GPU index (or be "all")')
        return None
    devices: list[int] = []
    first_seen: dict[int, str] = {}
    for i, item in enumerate(items):
        item_field = _Field(item, f"{field.key}[{i}]")
        device = r.integer(item_field, minimum=0, expected="a GPU index (an integer)")
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
    identity_file = r.string(block.field("identity_file"))
    if identity_file is not None:
        # The key is read by the local ssh client, so local rules apply even for remote hosts.
        identity_file = _resolve_path(identity_file, folder, is_local=True)
    options: list[str] = []
    options_field = block.field("options")
    for i, item in enumerate(r.sequence(options_field) or []):
        option_field = _Field(item, f"{options_field.key}[{i}]")
        option = r.string(option_field)
        if option is None:
            continue
        # ssh_config keywords are alphanumeric; catching "-oX=y" or "X y" here beats an ssh
        # usage error on one host in the middle of a launch.
        if not _SSH_OPTION_RE.fullmatch(option):
            r.problem(
                option_field,
                f"expected 'Key=Value' (an ssh -o option, e.g. "
                f"'StrictHostKeyChecking=accept-new'), got {option!r}",
            )
            continue
        options.append(option)
    return SshSpec(
        target=r.string(block.field("target")),
        user=r.string(block.field("user")),
        port=r.integer(block.field("port"), minimum=1, maximum=65535),
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
_INVALID = object()  # a scalar we refuse to construct (unknown tag or bad explicit tag)


class _Field(NamedTuple):
    """A value node (None when the key is absent) and the key path used to report it."""

    node: Optional[Node]
    key: str


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
        if self.bracket_keys:
            return f"{self.path}[{json.dumps(name, ensure_ascii=False)}]"
        return f"{self.path}.{name}" if self.path else name

    def field(self, name: str) -> _Field:
        entry = self.entries.get(name)
        return _Field(entry[1] if entry else None, self.key(name))


def _line(node: Node) -> int:
    return int(node.start_mark.line) + 1


def _describe(node: Node) -> str:
    """Name a node the way the user wrote it ("string 'two'", "boolean yes"), in YAML terms."""
    kind = _KIND_BY_TAG.get(node.tag)
    if kind is None:
        return f"a value tagged {node.tag!r}"
    if not isinstance(node, ScalarNode) or kind == "null":
        return kind
    if kind == "string":
        return f"string {node.value!r}"
    return f"{kind} {node.value}"


class _Reader:
    """Type-checked access to YAML nodes that records problems instead of raising.

    Every reader returns None for an absent *or* invalid value, so callers can carry on and
    find the next problem; ``parse_cluster`` raises once at the end if anything was recorded.
    """

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self._constructor = SafeConstructor()

    def problem(self, field: _Field, message: str, at: Optional[Node] = None) -> None:
        """Record a problem at ``at`` (default: the field's own node)."""
        node = at if at is not None else field.node
        self.problems.append(
            Problem(self.file, field.key, None if node is None else _line(node), message)
        )

    def wrong_type(self, field: _Field, expected: str, hint: str = "") -> None:
        found = "nothing" if field.node is None else _describe(field.node)
        self.problem(field, f"expected {expected}, got {found}{hint}")

    def compose(self, text: str) -> Optional[Node]:
        """Parse without constructing anything; a syntax error becomes a located problem."""
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            # PyYAML splits its sentences: "while scanning a simple key" + "could not find..."
            reason = ", ".join(part for part in (exc.context, exc.problem) if part)
            line = None if mark is None else mark.line + 1
            self.problems.append(Problem(self.file, "", line, f"invalid YAML: {reason}"))
            return None
        except ReaderError as exc:  # e.g. a control character in the text
            line = text.count("\n", 0, int(exc.position)) + 1
            reason = str(exc).splitlines()[0]  # the rest names "<unicode string>", not the file
            self.problems.append(Problem(self.file, "", line, f"invalid YAML: {reason}"))
            return None
        if root is None:
            self.problems.append(
                Problem(self.file, "", None, "file is empty (expected a mapping with 'workers')")
            )
        return root

    def scalar(self, node: Node) -> object:
        """The Python value of a plain scalar, or ``_INVALID`` for anything else.

        Only the standard scalar tags are constructed, which is what keeps loading safe.
        """
        if not isinstance(node, ScalarNode) or node.tag not in _SCALAR_TAGS:
            return _INVALID
        try:
            return self._constructor.construct_object(node)
        except (yaml.YAMLError, ValueError, KeyError):  # e.g. "!!int abc"
            return _INVALID

    def mapping(
        self, field: _Field, what: str = "a mapping", bracket_keys: bool = False
    ) -> Optional[_Block]:
        """Entries of a mapping by key *text*; reports duplicate and non-scalar keys.

        Keys are taken as written rather than as YAML 1.1 values, so an env var named ``NO``
        or ``ON`` stays a name instead of becoming the boolean False/True.
        """
        node = field.node
        if node is None:
            return None
        if not isinstance(node, MappingNode) or node.tag != _TAG + "map":
            self.wrong_type(field, what)
            return None
        block = _Block(node, field.key, {}, bracket_keys)
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                self.problem(field, f"keys must be names, got {_describe(key_node)}", key_node)
                continue
            name = str(key_node.value)
            if name in block.entries:
                first_line = _line(block.entries[name][0])
                self.problem(
                    _Field(key_node, block.key(name)),
                    f"duplicate key {name!r} (first on line {first_line})",
                )
                continue
            block.entries[name] = (key_node, value_node)
        return block

    def block(
        self, field: _Field, allowed: tuple[str, ...], what: str = "a mapping"
    ) -> Optional[_Block]:
        """A mapping with a fixed set of keys; unknown keys are reported with a suggestion."""
        block = self.mapping(field, what)
        if block is None:
            return None
        for name, (key_node, _) in list(block.entries.items()):
            if name in allowed:
                continue
            message = f"unknown key {name!r}"
            close = difflib.get_close_matches(name, allowed, n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
            self.problem(_Field(key_node, block.key(name)), message)
            del block.entries[name]
        return block

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
        if not value.strip():
            self.problem(field, "must not be empty")
            return None
        return value

    def boolean(self, field: _Field) -> Optional[bool]:
        if field.node is None:
            return None
        value = self.scalar(field.node)
        if not isinstance(value, bool):
            self.wrong_type(field, "a boolean (true or false)")
            return None
        return value

    def integer(
        self,
        field: _Field,
        *,
        minimum: int,
        maximum: Optional[int] = None,
        expected: str = "an integer",
    ) -> Optional[int]:
        if field.node is None:
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

    def number(self, field: _Field, *, minimum: float, exclusive: bool = False) -> Optional[float]:
        """A finite int or float; ``exclusive`` makes ``minimum`` itself invalid."""
        if field.node is None:
            return None
        value = self.scalar(field.node)
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
        return number

    def env(self, field: _Field) -> dict[str, str]:
        """Environment variables, checked so that every entry can really be exported."""
        block = self.mapping(field, bracket_keys=True)
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
            if "\0" in value:
                self.problem(value_field, "value contains a NUL character (not allowed in env)")
                continue
            env[name] = value
        return env


def _env_type_message(node: Node) -> str:
    """Explain a non-string env value and how to write it, since `N: 8` is an easy slip."""
    message = f"value must be a string, got {_describe(node)}"
    if not isinstance(node, ScalarNode):
        return message
    if node.tag == _TAG + "null":
        return message + ' (write "" for an empty value)'
    return message + f" (quote it in YAML: {json.dumps(node.value, ensure_ascii=False)})"

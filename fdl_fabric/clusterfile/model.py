"""The cluster.yml model: frozen dataclasses with every default applied.

No other module re-reads or re-checks YAML: `loading` turns a file into a `ClusterSpec`
(through `schema`, `yamlread` and `names`), and everything downstream reads these.
Also here: the environment names the launcher owns, and what ``max_failure`` means.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------

#: ``fanout``: SSH hosts the launcher connects to directly; beyond it, a gateway tree
#: (`fdl_fabric.planning.tree`). 64 as in ClusterShell; PRRTE's radix is 64, pdsh's 32.
FANOUT_DEFAULT = 64
#: The widest fanout a file may ask for.
FANOUT_MAX = 1024
#: ``master_port`` when the file gives none, and ``--master-port`` when ranks span hosts:
#: torch.distributed's customary port, torchrun's and DeepSpeed's default.
MASTER_PORT_DEFAULT = 29500


@dataclass(frozen=True)
class SshSpec:
    """How to reach a remote worker; every field falls back to the user's ssh config."""

    target: Optional[str] = None
    user: Optional[str] = None
    port: Optional[int] = None
    identity_file: Optional[str] = None
    options: tuple[str, ...] = ()
    #: An ssh_config file read instead of ``~/.ssh/config`` (``ssh -F``, ``--ssh-config``).
    config_file: Optional[str] = None
    #: ``allow_commands: true``, as the file says: its ``config_file`` may run commands
    #: (``ProxyCommand``, ``Match exec``...). Honoured only in a file the operator owns.
    allow_commands: bool = False
    #: The launcher's decision (`transport.configtrust.with_trust`): the operator allowed
    #: this ssh_config to run commands (``--trust-ssh-config``, or ``allow_commands`` in
    #: a file they own). Never read from a file.
    commands_trusted: bool = False


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
    #: The host names this machine (``localhost``, its host name): where it is, which
    #: decides loopback addresses and local paths; not how it is reached (``transport``).
    is_local: bool
    line: int
    #: Names or globs of launcher variables carried to this worker's ranks.
    env_forward: tuple[str, ...] = ()
    #: The Slurm job whose allocation holds this node: its agent starts as an srun step
    #: of that job, never over SSH (`fdl_fabric.transport.slurm`).
    slurm_job: Optional[str] = None
    #: The kind of `fdl_fabric.transport` the file names (``transport:``), or None: the
    #: transport package infers it from the host (`transport.kinds`). Only that package
    #: reads it; ``is_local`` is another fact, where the host is, not how it is reached.
    transport: Optional[str] = None
    #: The rest of a ``transport: {kind: NAME, ...}`` block: the kind's own settings, as
    #: plain values, read by that kind (`Transport.resolve_settings`).
    transport_settings: Mapping[str, Any] = field(default_factory=dict)
    #: The line of the ``transport:`` key (0: none), where a kind's refusal points.
    transport_line: int = 0
    #: ``spare: true``: not started unless a host of the roster is lost
    #: (`supervision.membership`).
    spare: bool = False
    #: ``python``: this host's interpreter for ranks whose command starts with
    #: ``python``/``python3`` (over the cluster's); relative to the ranks' folder.
    python: Optional[str] = None

    @property
    def ssh_target(self) -> str:
        """``host`` doubles as the ssh destination unless the file says otherwise."""
        return self.ssh.target or self.host

    @property
    def known_ranks(self) -> Optional[int]:
        """Its ranks as the file gives them: ``nproc``, or its listed devices; None for
        ``local_devices: all`` or a joiner that says its own (known from the host)."""
        if self.nproc is not None:
            return self.nproc
        return len(self.local_devices) if isinstance(self.local_devices, tuple) else None


@dataclass(frozen=True)
class SlurmSpec:
    """``scheduler: slurm``: the workers are the nodes of the Slurm allocation the launch
    runs in, each with the same ranks; known only at launch (`fdl_fabric.transport.slurm`)."""

    nproc_per_node: Optional[int] = None
    local_devices: Union[tuple[int, ...], str, None] = None
    #: The ranks' working directory on every node (nodes usually share a file system).
    path: Optional[str] = None
    #: The allocation's job id once the launch resolved it (SLURM_JOB_ID).
    job_id: Optional[str] = None
    line: int = 0


#: The transport kind of a worker whose agent dials in (`fdl-fabric join`).
JOIN_KIND = "join"


class StartMode(str, Enum):
    """Who closes a join window once its quorum is in (flodl's ``start``)."""

    #: The window's own rules: the target, or the window's end with the quorum.
    AUTO = "auto"
    #: Only the operator (`fdl-fabric start`), once the quorum is in.
    MANUAL = "manual"
    #: Either: the operator's start, or the window's own rules.
    HYBRID = "hybrid"


@dataclass(frozen=True)
class JoinSpec:
    """``controller.join``: the window in which workers that dial in are admitted."""

    #: The quorum: the world cannot form with fewer ranks.
    min_ranks: int
    #: Closes the window as soon as this many ranks are in (not under ``manual``).
    target_ranks: Optional[int] = None
    #: The window's length; a quorum reached early does not close it.
    join_timeout: float = 300.0
    #: The hard cap: a quorum still unmet then fails the run.
    max_join_timeout: float = 600.0
    #: No roster: any worker that holds the token may walk in under any host name.
    discovery: bool = False
    #: The operator's token file (0600); None: a fresh token in the run's record.
    token_file: Optional[str] = None
    start: StartMode = StartMode.AUTO
    #: The one port a joiner dials (its ranks reach the coordinator through its agent).
    port: int = 1338
    #: The address the window listens on (None: ``controller.host``).
    bind: Optional[str] = None
    #: A joiner offering more ranks than this is refused.
    max_ranks_per_host: int = 256
    line: int = 0


@dataclass(frozen=True)
class ControllerSpec:
    """Where every rank reports; loopback by default so a one-machine run needs no setup."""

    host: str = "127.0.0.1"
    port: int = 1337
    #: The join window (``controller.join``), if workers dial in.
    join: Optional[JoinSpec] = None


@dataclass(frozen=True)
class ElasticSpec:
    """Failure tolerance; timeouts are base values, later scaled by FLODL_NET_TIMEOUT_SCALE."""

    max_failure: Union[int, float, None] = None
    formation_timeout: float = 300.0
    heartbeat_timeout: float = 30.0
    #: Times the whole group is started again after a failed attempt (torchrun's
    #: ``--max-restarts``).
    max_restarts: int = 0
    #: The fewest hosts an attempt may start with (torchrun's ``--nnodes MIN:``). None:
    #: every worker that is not a spare, and then every attempt runs on the whole roster
    #: as before (`supervision.membership`).
    min_hosts: Optional[int] = None
    #: A host whose ranks failed, or that was lost, in this many attempts in a row is set
    #: aside for the rest of the launch (Horovod's blacklist).
    host_failures: int = 3


@dataclass(frozen=True)
class SyncSpec:
    """``sync:``: the local folder whose contents every remote worker runs
    (docs/code-and-environment.md)."""

    #: The local folder, absolute: the cluster file's folder unless ``src`` says otherwise.
    src: str
    #: gitignore-style patterns never sent (``.git/``, run records and ``--log-dir`` never are).
    exclude: tuple[str, ...] = ()
    line: int = 0


@dataclass(frozen=True)
class SetupSpec:
    """``setup:``: one command run once per host in the synced folder before the first
    attempt, again only when it or its ``setup_inputs`` changed."""

    command: str
    #: Files of the synced folder whose contents, with the command, decide a re-run.
    inputs: tuple[str, ...] = ()
    #: ``setup_timeout``: seconds the command may take on a host.
    timeout: float = 1800.0
    line: int = 0


@dataclass(frozen=True)
class VersionsSpec:
    """What the pre-flight compares across hosts (``check_packages``, ``strict_versions``)."""

    #: Packages whose versions must agree; None: torch, when the interpreter has it.
    packages: Optional[tuple[str, ...]] = None
    #: A mismatch is a FAIL rather than a warning.
    strict: bool = False


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
    #: SSH hosts connected directly; more than this go through gateways (`planning.tree`).
    fanout: int = FANOUT_DEFAULT
    #: The flag that named the hosts (``--hosts``, ``--hostfile``) when no cluster file
    #: did: advice then speaks in flags, and no worker has a line of a file to point at.
    named_by: Optional[str] = None
    #: ``on_exit``: a shell command run once when the run ends (`runs.hook`).
    on_exit: Optional[str] = None
    #: ``sync:``: the code every remote worker runs; None: the hosts' own ``path``.
    sync: Optional[SyncSpec] = None
    #: ``setup:``: once per host, before the first attempt.
    setup: Optional[SetupSpec] = None
    #: ``python``: the ranks' interpreter (a worker's own wins).
    python: Optional[str] = None
    #: ``check_packages`` and ``strict_versions``.
    versions: VersionsSpec = VersionsSpec()
    #: ``secret_env``: variables (names or globs) whose values are secrets whatever
    #: they look like: shown and kept as ``***`` (`masking`).
    secret_env: tuple[str, ...] = ()


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



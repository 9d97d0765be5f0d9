"""The cluster.yml schema: one function per block, each key's type, range and meaning.

It reads the YAML node tree through `yamlread.NodeReader` (which records problems instead of
raising) and builds the `config` model, with defaults applied and every count and size that
later code multiplies checked (workers, ranks, env variables, command bytes), so
`config.load_cluster` refuses a file before anything downstream allocates per-rank data.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional, TypeVar, Union

from yaml.nodes import Node, ScalarNode

from ..agent.wire import AGENT_TIMEOUT_MIN
from ..limits import (
    ARG_STRLEN_MAX,
    ENV_MAX_BYTES,
    ENV_NAME_MAX,
    ENV_VARS_MAX,
    NUMBER_MAX_CHARS,
    PORT_MAX,
    RANKS_MAX,
    RANKS_PER_WORKER_MAX,
    RESTARTS_MAX,
    SECONDS_MAX,
    SSH_OPTIONS_MAX,
    WORKERS_MAX,
)
from .code import CODE_KEYS, read_code, read_python
from .model import (
    _MAX_FAILURE_FORMAT,
    ENV_NAME_RE,
    FANOUT_DEFAULT,
    FANOUT_MAX,
    ClusterSpec,
    ControllerSpec,
    ElasticSpec,
    SlurmSpec,
    SshSpec,
    WorkerSpec,
    is_reserved_env_key,
    parse_max_failure,
)
from .names import (
    SHOWN_MAX,
    command_problem,
    ifname_problem,
    shown,
    ssh_option_problem,
    ssh_target_problem,
    unicode_problem,
    user_name_problem,
)
from .transportkey import read_transport
from .yamlread import TAG, Block, Field, NodeReader, describe, line_of

_DEFAULT_KILL_GRACE = 10.0  # seconds a rank gets to exit cleanly before it is killed
_DEFAULT_MASTER_PORT = 29500  # torch.distributed's customary port
_DEFAULT_AGENT_TIMEOUT = ClusterSpec.agent_timeout

_TOP_KEYS = ("controller", "command", "env", "env_forward", "kill_grace", "master_port",
             "elastic", "workers", "scheduler", "nproc_per_node", "local_devices", "path",
             "agent_timeout", "hang_timeout", "fanout", "on_exit", *CODE_KEYS)
#: Top-level keys that only a Slurm launch reads: every node gets the same ranks.
_SLURM_KEYS = ("nproc_per_node", "local_devices", "path")
_CONTROLLER_KEYS = ("host", "port")
_ELASTIC_KEYS = ("max_failure", "formation_timeout", "heartbeat_timeout", "max_restarts",
                 "min_hosts", "host_failures")
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
    "spare",
    "python",
    "transport",
)
_SSH_KEYS = ("target", "user", "port", "identity_file", "options", "config_file")

_T = TypeVar("_T")


def _or(value: Optional[_T], default: _T) -> _T:
    """Absent and invalid both read as None; invalid ones are already recorded as problems
    (so the spec is discarded), which makes falling back to the default safe in both cases."""
    return default if value is None else value


def read_cluster(
    r: NodeReader, root: Node, folder: str, local_hostname: str
) -> Optional[ClusterSpec]:
    top = r.block(Field(root, ""), _TOP_KEYS, what="a mapping at the top level", extensions=True)
    if top is None:
        return None
    controller = _read_controller(r, top.field("controller"))
    command_field = top.field("command")
    command = r.string(command_field)
    if command is not None:
        command = r.checked(command_field, command, "command", command_problem)
    on_exit_field = top.field("on_exit")
    on_exit = r.string(on_exit_field)
    if on_exit is not None:
        on_exit = r.checked(on_exit_field, on_exit, "on_exit", command_problem)
    env_field = top.field("env")
    env = read_env(r, env_field)
    # A worker's check adds its own env to the cluster's; once the cluster env alone is too
    # big, saying so again for every worker would only bury the first message.
    rank_env = env if _check_rank_env(r, env_field, env, {}) else {}
    env_forward = _read_env_forward(r, top.field("env_forward"))
    kill_grace = r.number(top.field("kill_grace"), minimum=0.0, maximum=SECONDS_MAX)
    agent_timeout = r.number(top.field("agent_timeout"), minimum=AGENT_TIMEOUT_MIN,
                             maximum=SECONDS_MAX)
    hang_timeout = r.number(top.field("hang_timeout"), minimum=0.0, exclusive=True,
                            maximum=SECONDS_MAX)
    master_port = r.integer(top.field("master_port"), minimum=1, maximum=PORT_MAX)
    fanout = r.integer(top.field("fanout"), minimum=1, maximum=FANOUT_MAX)
    elastic = _read_elastic(r, top.field("elastic"))
    slurm = _read_slurm(r, top, folder)
    code = read_code(r, top, folder)

    workers: list[WorkerSpec] = []
    workers_field = top.field("workers")
    items = r.sequence(workers_field)
    if slurm is not None:
        if workers_field.node is not None:
            r.problem(workers_field, "a Slurm launch takes its workers from the allocation "
                      "(SLURM_JOB_NODELIST): remove workers, or remove scheduler: slurm")
        items = None
    elif workers_field.node is None:
        r.problem(workers_field, "workers is required (a list with one entry per host)", root)
    elif items == []:
        r.problem(workers_field, "must list at least one worker")
    elif items is not None and len(items) > WORKERS_MAX:
        r.problem(workers_field, f"lists {len(items)} workers; at most {WORKERS_MAX} are allowed")
        items = None
    seen_hosts: dict[str, tuple[str, int]] = {}
    for index, item in enumerate(items or []):
        field = Field(item, f"workers[{index}]")
        worker = _read_worker(
            r, field, index, folder, local_hostname, controller, rank_env, seen_hosts
        )
        if worker is not None:
            workers.append(worker)

    _check_roster(r, workers_field, top.field("elastic"), workers, elastic)
    _check_controller_dialable(r, top.field("controller"), controller,
                               slurm is not None or any(not w.is_local and not w.tunnel
                                                        for w in workers))

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
        slurm=slurm,
        agent_timeout=_or(agent_timeout, _DEFAULT_AGENT_TIMEOUT),
        on_exit=on_exit,
        hang_timeout=hang_timeout,
        fanout=_or(fanout, FANOUT_DEFAULT),
        sync=code.sync,
        setup=code.setup,
        python=code.python,
        versions=code.versions,
    )


def _read_slurm(r: NodeReader, top: Block, folder: str) -> Optional[SlurmSpec]:
    """``scheduler: slurm`` and the keys that go with it; None for an SSH cluster."""
    field = top.field("scheduler")
    scheduler = r.string(field)
    if scheduler is not None and scheduler != "slurm":
        r.problem(field, f'expected "slurm" (the one scheduler there is; leave scheduler out '
                  f"for workers reached over SSH), got {shown(scheduler)}")
    if scheduler != "slurm":
        for key in _SLURM_KEYS:
            if top.has(key):
                r.problem(top.field(key), f"{key} at the top level is for scheduler: slurm; "
                          "SSH workers set nproc, local_devices and path each")
        return None
    nproc = r.integer(top.field("nproc_per_node"), minimum=1, maximum=RANKS_PER_WORKER_MAX)
    local_devices = _read_local_devices(r, top.field("local_devices"))
    if top.has("nproc_per_node") and top.has("local_devices"):
        r.problem(field, "set either nproc_per_node (CPU ranks) or local_devices (GPU ranks), "
                  "not both")
    raw_path = r.path(top.field("path"))
    # Nodes share the file system the launch runs from, as Slurm assumes; `~` is left to
    # each node's agent, like a remote worker's.
    path = None if raw_path is None else _resolve_path(raw_path, folder, is_local=False)
    return SlurmSpec(nproc_per_node=nproc, local_devices=local_devices, path=path,
                     line=line_of(field.node) if field.node is not None else 0)


def _ranks_of(worker: WorkerSpec) -> int:
    if worker.nproc is not None:
        return worker.nproc
    return len(worker.local_devices) if isinstance(worker.local_devices, tuple) else 0


def _check_rank_env(
    r: NodeReader, field: Field, cluster_env: dict[str, str], worker_env: dict[str, str]
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


def _read_controller(r: NodeReader, field: Field) -> ControllerSpec:
    block = r.block(field, _CONTROLLER_KEYS)
    if block is None:
        return ControllerSpec()
    default = ControllerSpec()
    return ControllerSpec(
        host=_or(r.host(block.field("host")), default.host),
        port=_or(r.integer(block.field("port"), minimum=1, maximum=PORT_MAX), default.port),
    )


def _check_roster(r: NodeReader, workers_field: Field, elastic_field: Field,
                  workers: list[WorkerSpec], elastic: ElasticSpec) -> None:
    """Spares stand in for the roster, so there must be a roster; and an attempt needs
    ``min_hosts`` hosts, which the workers that are not spares must be able to give."""
    if not workers or r.problems:
        return
    roster = sum(1 for w in workers if not w.spare)
    if roster == 0:
        r.problem(workers_field, "every worker is a spare: at least one must not be")
    elif elastic.min_hosts is not None and elastic.min_hosts > roster:
        r.problem(elastic_field, f"min_hosts is {elastic.min_hosts}, but only {roster} "
                  f"worker(s) are not spares: an attempt never has more hosts than that")


def _check_controller_dialable(r: NodeReader, field: Field, controller: ControllerSpec,
                               dialed: bool) -> None:
    """When some worker dials the coordinator over the network (a remote worker that is not
    tunneled, or any Slurm node), ``controller.host`` is what it dials; a wildcard is only
    good for binding, so it would fail on every such worker."""
    if dialed and controller.host in ("0.0.0.0", "::", ""):
        r.problem(field, f"host {controller.host!r} is a wildcard: remote "
                  "workers need an address they can dial")


def _read_elastic(r: NodeReader, field: Field) -> ElasticSpec:
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
    min_hosts = r.integer(block.field("min_hosts"), minimum=1, maximum=WORKERS_MAX)
    host_failures = r.integer(block.field("host_failures"), minimum=1, maximum=RESTARTS_MAX)
    return ElasticSpec(
        max_failure=_read_max_failure(r, block.field("max_failure")),
        formation_timeout=_or(formation, default.formation_timeout),
        heartbeat_timeout=_or(heartbeat, default.heartbeat_timeout),
        max_restarts=_or(restarts, default.max_restarts),
        min_hosts=min_hosts,
        host_failures=_or(host_failures, default.host_failures),
    )


#: What an ``env_forward`` entry may be: a variable name, or a glob of one (``WANDB_*``).
_FORWARD_RE = re.compile(r"[A-Za-z_*?\[][A-Za-z0-9_*?\[\]!]*")


def _read_env_forward(r: NodeReader, field: Field) -> tuple[str, ...]:
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
        item_field = Field(item, f"{field.key}[{i}]")
        name = r.string(item_field)
        if name is None:
            continue
        if len(name) > ENV_NAME_MAX or not _FORWARD_RE.fullmatch(name):
            r.problem(item_field, "expected a variable name or a glob of one "
                      f"([A-Za-z_][A-Za-z0-9_]*, with * ? [...]), got {shown(name)}")
            continue
        if not any(c in name for c in "*?[") and is_reserved_env_key(name):
            r.problem(item_field, f"{name} is set by the launcher for each rank; it cannot be "
                      "forwarded")
            continue
        names.append(name)
    return tuple(names)


def _read_max_failure(r: NodeReader, field: Field) -> Union[int, float, None]:
    if field.node is None:
        return None
    value = r.scalar(field.node)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
        # Type mistakes are described in YAML terms ("boolean true"), not Python's ("True").
        r.wrong_type(field, _MAX_FAILURE_FORMAT)
        return None
    if isinstance(value, str) and len(value) > NUMBER_MAX_CHARS:
        r.problem(field, f"expected {_MAX_FAILURE_FORMAT}, got {describe(field.node)}")
        return None
    try:
        return parse_max_failure(value)
    except ValueError as exc:
        r.problem(field, str(exc))
        return None


def _read_worker(
    r: NodeReader,
    field: Field,
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

    # Problems are listed in the order they are recorded (and capped), so the keys are read
    # in a fixed order: host, ranks, ssh, tunnel, paths, addr, ifname, env.
    host = _read_worker_host(r, w, seen_hosts)
    nproc, local_devices = _read_worker_ranks(r, w, field)
    is_local = _is_local(host, local_hostname)
    # An ssh block on a local worker is validated but unused: it matters when the same file
    # is launched from another machine, where this worker is remote.
    ssh = _read_ssh(r, w.field("ssh"), folder)
    tunnel = _read_tunnel(r, w, is_local)
    raw_path = _read_worker_path(r, w, host, is_local)
    raw_data_path = r.path(w.field("data_path"))
    addr = _read_worker_addr(r, w, controller, ssh, host, is_local)
    nccl_socket_ifname = _read_ifname(r, w.field("nccl_socket_ifname"))
    env = _read_worker_env(r, w.field("env"), cluster_env)
    env_forward = _read_env_forward(r, w.field("env_forward"))
    spare = r.boolean(w.field("spare"))
    python = read_python(r, w.field("python"))
    kind, kind_settings = read_transport(r, w.field("transport"))

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
        transport=kind,
        transport_settings=kind_settings,
        transport_line=_line_or_zero(w.field("transport").node),
        line=line_of(w.node),
        env_forward=env_forward,
        spare=bool(spare),
        python=python,
    )


def _read_worker_host(
    r: NodeReader, w: Block, seen_hosts: dict[str, tuple[str, int]]
) -> Optional[str]:
    """The worker's ``host``, required and unique: the plan keys envelopes, agents and output
    prefixes by it, so two workers with one name would silently merge.

    Records where each name first appeared in ``seen_hosts``, so a duplicate names both places.
    """
    host_field = w.field("host")
    host = r.host(host_field)
    if host_field.node is None:
        r.problem(host_field, "host is required (a unique name for this worker)", w.node)
    elif host is not None and host in seen_hosts:
        first_key, first_line = seen_hosts[host]
        message = f"duplicate host {host!r} (also {first_key} on line {first_line})"
        r.problem(host_field, message + "; each worker needs its own name")
    elif host is not None:
        seen_hosts[host] = (host_field.key, line_of(host_field.node))
    return host


def _read_worker_ranks(
    r: NodeReader, w: Block, field: Field
) -> tuple[Optional[int], Union[tuple[int, ...], str, None]]:
    """``nproc`` and ``local_devices``: both say how many ranks the worker runs (CPU ranks, or
    one per GPU), so exactly one of them must be set or the count is ambiguous."""
    nproc = r.integer(w.field("nproc"), minimum=1, maximum=RANKS_PER_WORKER_MAX)
    local_devices = _read_local_devices(r, w.field("local_devices"))
    if w.has("nproc") and w.has("local_devices"):
        r.problem(field, "set either nproc (CPU ranks) or local_devices (GPU ranks), not both")
    elif not w.has("nproc") and not w.has("local_devices"):
        r.problem(field, "set nproc (CPU ranks) or local_devices (GPU ranks)")
    return nproc, local_devices


def _line_or_zero(node: Optional[Node]) -> int:
    return 0 if node is None else line_of(node)


def _is_local(host: Optional[str], local_hostname: str) -> bool:
    """Whether the worker runs on this machine, which decides whether we SSH at all.

    The same file is launched from different machines, so it is a property of (file, this
    machine), never of the file alone.
    """
    return host is not None and host in (local_hostname, "localhost")


def _read_tunnel(r: NodeReader, w: Block, is_local: bool) -> bool:
    """``tunnel`` makes the ranks dial the controller through an SSH remote forward; a local
    worker has no SSH connection to forward over, so asking for one is a mistake."""
    tunnel_field = w.field("tunnel")
    tunnel = _or(r.boolean(tunnel_field), False)
    if tunnel and is_local:
        r.problem(tunnel_field, "tunnel is only for remote workers; this one runs on this machine")
    return tunnel


def _read_worker_path(
    r: NodeReader, w: Block, host: Optional[str], is_local: bool
) -> Optional[str]:
    """The worker's ``path`` as written (not yet resolved). A local worker defaults to the
    file's folder, but the launcher cannot guess a working directory on another host, so a
    remote worker must name one."""
    path_field = w.field("path")
    raw_path = r.path(path_field)
    if path_field.node is None and host is not None and not is_local:
        message = "path is required for a remote worker (its working directory on that host)"
        r.problem(path_field, message, w.node)
    return raw_path


def _read_worker_addr(
    r: NodeReader,
    w: Block,
    controller: ControllerSpec,
    ssh: SshSpec,
    host: Optional[str],
    is_local: bool,
) -> str:
    """The address other ranks reach this worker at (``MASTER_ADDR`` when it holds rank 0).

    When ``addr`` is not set, local ranks talk to each other the way they reach the
    controller. For a remote worker the ssh destination is the best guess of a reachable
    address; a "user@" prefix is an ssh detail, not part of the address.
    """
    addr = r.host(w.field("addr"))
    if addr is not None:
        return addr
    return controller.host if is_local else (ssh.target or host or "").rpartition("@")[2]


def _read_ifname(r: NodeReader, field: Field) -> Optional[str]:
    """``nccl_socket_ifname``, checked now because it is exported into every rank's
    environment: it must be one line and fit in one environment string."""
    ifname = r.string(field)
    if ifname is None:
        return None
    return r.checked(field, ifname, "ifname", ifname_problem)


def _read_worker_env(
    r: NodeReader, field: Field, cluster_env: dict[str, str]
) -> dict[str, str]:
    """The worker's ``env``, checked together with the cluster's: each of the worker's ranks
    gets both, so it is their union that must fit in one rank's environment."""
    env = read_env(r, field)
    if env:
        _check_rank_env(r, field, cluster_env, env)
    return env


def _read_local_devices(r: NodeReader, field: Field) -> Union[tuple[int, ...], str, None]:
    if field.node is None:
        return None
    expected = 'a list of GPU indices or "all"'
    if isinstance(field.node, ScalarNode):
        value = r.scalar(field.node)
        if value == "all":
            return "all"
        if isinstance(value, str):
            r.problem(field, f"expected {expected}, got {shown(value)}")
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
        item_field = Field(item, f"{field.key}[{i}]")
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


def _read_ssh(r: NodeReader, field: Field, folder: str) -> SshSpec:
    block = r.block(field, _SSH_KEYS)
    if block is None:
        return SshSpec()
    identity_file = r.path(block.field("identity_file"))
    if identity_file is not None:
        # The key is read by the local ssh client, so local rules apply even for remote hosts.
        identity_file = _resolve_path(identity_file, folder, is_local=True)
    config_file = r.path(block.field("config_file"))
    if config_file is not None:
        config_file = _resolve_path(config_file, folder, is_local=True)
    options: list[str] = []
    options_field = block.field("options")
    items = r.sequence(options_field)
    if items is not None and len(items) > SSH_OPTIONS_MAX:
        message = f"lists {len(items)} options; at most {SSH_OPTIONS_MAX} are allowed"
        r.problem(options_field, message)
        items = None
    for i, item in enumerate(items or []):
        option_field = Field(item, f"{options_field.key}[{i}]")
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
        config_file=config_file,
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



def read_env(r: NodeReader, field: Field) -> dict[str, str]:
    """Environment variables, checked so that every entry can really be exported."""
    block = r.mapping(field, bracket_keys=True, max_entries=ENV_VARS_MAX)
    if block is None:
        return {}
    env: dict[str, str] = {}
    for name, (key_node, value_node) in block.entries.items():
        entry = block.key(name)
        if not ENV_NAME_RE.fullmatch(name):
            r.problem(
                Field(key_node, entry),
                "not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
            )
            continue
        if len(name) > ENV_NAME_MAX:
            message = f"name is {len(name)} characters long; at most {ENV_NAME_MAX}"
            r.problem(Field(key_node, entry), message)
            continue
        if is_reserved_env_key(name):
            r.problem(
                Field(key_node, entry),
                "is reserved (set by the launcher for each rank); "
                "GPU pinning belongs in local_devices",
            )
            continue
        value_field = Field(value_node, entry)
        value = r.scalar(value_node)
        if not isinstance(value, str):
            r.problem(value_field, _env_type_message(value_node))
            continue
        size = len(name) + 1 + r.utf8_size(value)
        if size > ARG_STRLEN_MAX:
            r.problem(
                value_field,
                f"{name}=value is {size} bytes long; Linux limits one environment string "
                f"to {ARG_STRLEN_MAX} bytes (MAX_ARG_STRLEN)",
            )
            continue
        if r.checked(value_field, value, "env-value", _env_value_problem) is None:
            continue
        env[name] = value
    return env



def _env_value_problem(value: str) -> Optional[str]:
    if "\0" in value:
        return "value contains a NUL character (not allowed in env)"
    return unicode_problem(value)


def _env_type_message(node: Node) -> str:
    """Explain a non-string env value and how to write it, since `N: 8` is an easy slip."""
    message = f"value must be a string, got {describe(node)}"
    if not isinstance(node, ScalarNode):
        return message
    if node.tag == TAG + "null":
        return message + ' (write "" for an empty value)'
    if len(node.value) > SHOWN_MAX:
        return message + " (quote it in YAML)"
    return message + f" (quote it in YAML: {json.dumps(node.value, ensure_ascii=False)})"

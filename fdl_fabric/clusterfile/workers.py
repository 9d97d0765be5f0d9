"""One worker of the cluster file: its host, ranks, paths, address, interface, env,
``ssh:`` block and ``transport:`` key, each read in a fixed order so problems are listed
in the order of the keys (`schema.read_cluster` reads the list).
"""

from __future__ import annotations

import os
from typing import Optional, Union

from yaml.nodes import MappingNode, Node, ScalarNode

from ..limits import (
    PORT_MAX,
    RANKS_PER_WORKER_MAX,
    SSH_OPTIONS_MAX,
)
from .code import read_python
from .model import (
    JOIN_KIND,
    ControllerSpec,
    SshSpec,
    WorkerSpec,
)
from .names import (
    ifname_problem,
    shown,
    ssh_option_problem,
    ssh_target_problem,
    user_name_problem,
)
from .transportkey import read_transport
from .values import _check_rank_env, _or, _read_env_forward, read_env
from .yamlread import Block, Field, NodeReader, line_of

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
_SSH_KEYS = ("target", "user", "port", "identity_file", "options", "config_file",
             "allow_commands")


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
    joins = _joins(w)
    raw_path = _read_worker_path(r, w, host, is_local or joins)
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
        path=("" if joins else folder) if raw_path is None else _resolve_path(raw_path, folder,
                                                                              is_local),
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


def _joins(w: Block) -> bool:
    """The worker's agent dials in (``transport: join``): its joiner says its folder
    (``fdl-fabric join --path``), so the file need not."""
    node = w.entries.get("transport", (None, None))[1]
    if isinstance(node, MappingNode):
        node = next((v for k, v in node.value if getattr(k, "value", None) == "kind"), None)
    return isinstance(node, ScalarNode) and node.value == JOIN_KIND


def _read_worker_path(
    r: NodeReader, w: Block, host: Optional[str], is_local: bool
) -> Optional[str]:
    """The worker's ``path`` as written (not yet resolved). A local worker defaults to the
    file's folder, but the launcher cannot guess a working directory on another host, so a
    remote worker must name one (a worker that joins says its own)."""
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
        # Only a claim: `transport.configtrust.with_trust` honours it in a file the
        # operator owns.
        allow_commands=bool(r.boolean(block.field("allow_commands"))),
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




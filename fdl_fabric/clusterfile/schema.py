"""The cluster.yml schema: one function per block, each key's type, range and meaning.

It reads the YAML node tree through `yamlread.NodeReader` (which records problems instead of
raising) and builds the `config` model, with defaults applied and every count and size that
later code multiplies checked (workers, ranks, env variables, command bytes), so
`config.load_cluster` refuses a file before anything downstream allocates per-rank data.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Optional, Union

from yaml.nodes import MappingNode, Node, ScalarNode

from .. import masking
from ..agent.wire import AGENT_TIMEOUT_MIN
from ..limits import (
    NUMBER_MAX_CHARS,
    PORT_MAX,
    RANKS_MAX,
    RANKS_PER_WORKER_MAX,
    RESTARTS_MAX,
    SECONDS_MAX,
    WORKERS_MAX,
)
from .code import CODE_KEYS, read_code
from .join import read_join
from .model import (
    _MAX_FAILURE_FORMAT,
    FANOUT_DEFAULT,
    FANOUT_MAX,
    MASTER_PORT_DEFAULT,
    ClusterSpec,
    ControllerSpec,
    ElasticSpec,
    SlurmSpec,
    WorkerSpec,
    parse_max_failure,
)
from .names import (
    command_problem,
    shown,
)
from .values import _check_rank_env, _or, _read_env_forward, read_env, read_secret_env
from .workers import _read_local_devices, _read_worker, _resolve_path
from .yamlread import Block, Field, NodeReader, describe, line_of

_DEFAULT_KILL_GRACE = 10.0  # seconds a rank gets to exit cleanly before it is killed
_DEFAULT_AGENT_TIMEOUT = ClusterSpec.agent_timeout

_TOP_KEYS = ("controller", "command", "env", "env_forward", "kill_grace", "master_port",
             "elastic", "workers", "scheduler", "nproc_per_node", "local_devices", "path",
             "agent_timeout", "hang_timeout", "fanout", "on_exit", "secret_env", *CODE_KEYS)
#: Top-level keys that only a Slurm launch reads: every node gets the same ranks.
_SLURM_KEYS = ("nproc_per_node", "local_devices", "path")
_CONTROLLER_KEYS = ("host", "port", "join")
_ELASTIC_KEYS = ("max_failure", "formation_timeout", "heartbeat_timeout", "max_restarts",
                 "min_hosts", "host_failures")

def read_cluster(
    r: NodeReader, root: Node, folder: str, local_hostname: str
) -> Optional[ClusterSpec]:
    top = r.block(Field(root, ""), _TOP_KEYS, what="a mapping at the top level", extensions=True)
    if top is None:
        return None
    controller = _read_controller(r, top.field("controller"))
    command = _read_command(r, top.field("command"), "command")
    on_exit = _read_command(r, top.field("on_exit"), "on_exit")
    env_field = top.field("env")
    env = read_env(r, env_field)
    # A worker's check adds its own env to the cluster's; once the cluster env alone is too
    # big, saying so again for every worker would only bury the first message.
    rank_env = env if _check_rank_env(r, env_field, env, {}) else {}
    env_forward = _read_env_forward(r, top.field("env_forward"))
    secret_env = read_secret_env(r, top.field("secret_env"))
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

    workers_field = top.field("workers")
    seen_hosts: dict[str, tuple[str, int]] = {}
    discovery = _discovery(r, top.field("controller"))
    workers = [worker for index, item in enumerate(_worker_items(r, workers_field, slurm, root,
                                                                 discovery))
               if (worker := _read_worker(r, Field(item, f"workers[{index}]"), index, folder,
                                          local_hostname, controller, rank_env, seen_hosts))
               is not None]

    join_field = _join_field(r, top.field("controller"))
    controller = dataclasses.replace(controller, join=read_join(
        r, join_field, workers, folder, controller.port))
    _check_roster(r, workers_field, top.field("elastic"), workers, elastic)
    _check_controller_dialable(r, top.field("controller"), controller,
                               slurm is not None or any(not w.is_local and not w.tunnel
                                                        for w in workers))

    _check_ranks(r, workers_field, workers)
    if r.problems:
        return None
    _declare_secrets(secret_env, [env, *(w.env for w in workers)])
    return ClusterSpec(
        file=r.file,
        folder=folder,
        controller=controller,
        command=command,
        env=env,
        kill_grace=_or(kill_grace, _DEFAULT_KILL_GRACE),
        master_port=_or(master_port, MASTER_PORT_DEFAULT),
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
        secret_env=secret_env,
    )


def _declare_secrets(names: tuple[str, ...], envs: list[dict[str, str]]) -> None:
    """``secret_env``'s names, and the values the file gives them, are secrets from now
    on in this process (`masking.declare`): from the first thing shown or kept (the
    run's record opens before its plan is built), not only from the plan's."""
    if names:
        masking.declare(names, [value for env in envs for key, value in env.items()
                                if any(fnmatch.fnmatchcase(key, name) for name in names)])


def _read_command(r: NodeReader, field: Field, name: str) -> Optional[str]:
    """``command`` or ``on_exit``: a command line, checked as one."""
    value = r.string(field)
    return None if value is None else r.checked(field, value, name, command_problem)


def _worker_items(r: NodeReader, field: Field, slurm: Optional[SlurmSpec],
                  root: Node, discovery: bool) -> list[Node]:
    """The ``workers`` list's entries, or none when the list is wrong or a Slurm launch
    takes its workers from the allocation. A discovery window's walk-ins may be the whole
    world: then the list may be absent or empty."""
    items = r.sequence(field)
    if slurm is not None:
        if field.node is not None:
            r.problem(field, "a Slurm launch takes its workers from the allocation "
                      "(SLURM_JOB_NODELIST): remove workers, or remove scheduler: slurm")
        return []
    if discovery:
        pass
    elif field.node is None:
        r.problem(field, "workers is required (a list with one entry per host; a roster-free "
                  "window needs controller.join.discovery: true)", root)
    elif items == []:
        r.problem(field, "must list at least one worker (a roster-free window needs "
                  "controller.join.discovery: true)")
    elif items is not None and len(items) > WORKERS_MAX:
        r.problem(field, f"lists {len(items)} workers; at most {WORKERS_MAX} are allowed")
        return []
    return items or []


def _check_ranks(r: NodeReader, field: Field, workers: list[WorkerSpec]) -> None:
    """Every rank gets its own environment in the plan, so the total is what memory
    scales with. `local_devices: all` counts 0 here: its length is only known from the
    host."""
    ranks = sum(w.known_ranks or 0 for w in workers)
    if ranks > RANKS_MAX:
        r.problem(field, f"the workers have {ranks} ranks in total; at most {RANKS_MAX} "
                  "are allowed")


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


def _read_controller(r: NodeReader, field: Field) -> ControllerSpec:
    block = r.block(field, _CONTROLLER_KEYS)
    if block is None:
        return ControllerSpec()
    default = ControllerSpec()
    return ControllerSpec(
        host=_or(r.host(block.field("host")), default.host),
        port=_or(r.integer(block.field("port"), minimum=1, maximum=PORT_MAX), default.port),
    )


def _join_field(r: NodeReader, field: Field) -> Field:
    """``controller.join``'s field (its node None when absent). Read with a reader of its
    own: `_read_controller` says the controller block's problems once."""
    block = NodeReader(r.file).mapping(field) if field.node is not None else None
    return block.field("join") if block is not None else Field(None, "controller.join")


def _discovery(r: NodeReader, field: Field) -> bool:
    """Whether ``controller.join.discovery`` is true, read ahead of the workers (a
    roster-free window lets the list be empty); its problems are said by `read_join`."""
    join = _join_field(r, field)
    if not isinstance(join.node, MappingNode):
        return False
    for key, value in join.node.value:
        if isinstance(key, ScalarNode) and key.value == "discovery":
            return isinstance(value, ScalarNode) and value.value in ("true", "True", "TRUE")
    return False


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

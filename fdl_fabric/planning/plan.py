"""The launch plan: which rank runs where, with what environment and command.

A plan is pure data computed from a `ClusterSpec`, the device lists of
``local_devices: all`` workers (resolved over SSH beforehand) and the run's
identity. The launcher executes it, ``--dry-run`` prints it, and the tests
check it without any process or socket.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import limits, masking
from ..agent.wire import VERSION as AGENT_PROTOCOL
from ..clusterfile import ClusterSpec, WorkerSpec, is_reserved_env_key
from ..rank import HEARTBEAT_INTERVAL as RANK_HEARTBEAT_INTERVAL
from .envelope import (
    ENV_CLUSTER_JSON,
    ENV_CLUSTER_KEY,
    ENV_HOST_NAME,
    ENV_LOCAL_RANK,
    ENV_NET_TIMEOUT_SCALE,
    ENV_RUN_ID,
    ENV_VERBOSITY,
    PrebuiltBinary,
    SlimEnvelope,
)

#: Launcher variables forwarded to every rank when set where the launcher runs.
FORWARDED_ENV = (ENV_VERBOSITY, ENV_NET_TIMEOUT_SCALE)

#: torchrun's role name; fdl-fabric has one role.
ROLE_NAME = "default"

#: Set to 1 for every rank of a host running more than one, unless the user set it:
#: otherwise each rank starts a thread per core and they fight for them (torchrun does
#: the same, with a notice: `Name.OMP_DEFAULTED`).
OMP_DEFAULT = {"OMP_NUM_THREADS": "1"}


#: The first words a ``python:`` interpreter replaces, by their basename: ``python``,
#: ``python3``, ``python3.N``. A path counts too (``/usr/bin/python3``): `fdl-fabric run`
#: writes the launcher's own interpreter as a path, and ``python:`` exists so that every
#: host runs the one interpreter it names, whatever each command happens to spell.
_INTERPRETER_RE = re.compile(r"python(?:3(?:\.[0-9]+)?)?")


@dataclass(frozen=True)
class RankPlan:
    """One rank: its identity, where it runs and exactly what it executes."""

    rank: int
    local_rank: int
    worker: WorkerSpec
    device: Optional[int]
    cwd: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)

    @property
    def host(self) -> str:
        return self.worker.host

    @property
    def label(self) -> str:
        """The output prefix body, ``host:device:rN`` (``cpu`` for CPU ranks)."""
        dev = "cpu" if self.device is None else str(self.device)
        return f"{self.worker.host}:{dev}:r{self.rank}"



@dataclass(frozen=True)
class LaunchPlan:
    cluster: ClusterSpec
    run_id: str
    salt: bytes
    ranks: tuple[RankPlan, ...]
    envelopes: dict[str, SlimEnvelope] = field(repr=False)
    bind_loopback: bool
    #: Which attempt of the run this is (0, then 1.. after restarts).
    attempt: int = 0
    #: Of the defaults' names, those set where the launcher runs (local ranks inherit them).
    launcher_sets: frozenset[str] = frozenset()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def master_addr(self) -> str:
        """``MASTER_ADDR``, as every rank got it (rank 0's host's address)."""
        return self.ranks[0].env["MASTER_ADDR"]

    def envelope_hex(self, host: str) -> str:
        return self.envelopes[host].to_hex()

    def rank_environment(self, rank: RankPlan) -> dict[str, str]:
        """The full environment of a rank, envelope included (a secret)."""
        return {ENV_CLUSTER_JSON: self.envelope_hex(rank.host), **rank.env}

    def host_ranks(self, host: str) -> list[RankPlan]:
        """A host's ranks, in rank order (an index built once: a scan of every rank per
        host made planning 1,024 hosts x 8 quadratic, half the launcher's CPU to all
        running in issue 23's emulator)."""
        return list(self._by_host.get(host, ()))

    def hosts(self) -> list[str]:
        """Hosts that carry ranks, in roster order."""
        return list(self._by_host)

    @functools.cached_property
    def _by_host(self) -> dict[str, tuple[RankPlan, ...]]:
        grouped: dict[str, list[RankPlan]] = {}
        for r in self.ranks:
            grouped.setdefault(r.host, []).append(r)
        return {h: tuple(rs) for h, rs in grouped.items()}

    def defaults(self, host: str) -> dict[str, str]:
        """Variables a host's ranks get only where their environment does not set them."""
        ranks = self.host_ranks(host)
        if len(ranks) < 2:
            return {}
        local = ranks[0].worker.is_local
        return {k: v for k, v in OMP_DEFAULT.items()
                if k not in ranks[0].env and not (local and k in self.launcher_sets)}

    def agent_spec(self, host: str, *, checks: Optional[dict[str, Any]] = None,
                   start_now: bool = False, lease: Optional[float] = None,
                   launcher: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """What one host's agent is told (docs/protocol.md, ``spec``); carries the salt.

        Variables every rank of the host shares are sent once (``env``); each rank's
        entry holds only its own (``RANK``, ``LOCAL_RANK``, a GPU pin...). ``defaults``
        apply where the host's own environment does not set the variable; the agent
        sets ``TORCHELASTIC_ERROR_FILE`` itself, under its host's run registry.
        """
        ranks = self.host_ranks(host)
        common = dict(ranks[0].env)
        for r in ranks[1:]:
            common = {k: v for k, v in common.items() if r.env.get(k) == v}
        return {
            "version": AGENT_PROTOCOL,
            "mode": "run",
            "run_id": self.run_id,
            "cluster": cluster_key(self.cluster),
            "host": host,
            "kill_grace": self.cluster.kill_grace,
            "cwd": ranks[0].cwd,
            "argv": list(ranks[0].argv),
            "env": common,
            "ranks": [{"rank": r.rank, "env": {k: v for k, v in r.env.items()
                                               if k not in common}} for r in ranks],
            "defaults": self.defaults(host),
            "error_files": True,
            "attempt": self.attempt,
            "envelope": self.envelope_hex(host),
            "checks": checks,
            "start_now": start_now,
            "lease": lease,
            "launcher": launcher,
            "beats_every": beats_every(self.cluster.elastic.heartbeat_timeout,
                                       self.cluster.hang_timeout),
        }


def beats_every(heartbeat_timeout: float, hang_timeout: Optional[float] = None) -> float:
    """How often an agent sends its ranks' folded heartbeats, which carry their progress
    too (`limits.BEATS_PER_TIMEOUT`): at 1,024 hosts a frame a host a second was most of
    the launcher's idle CPU. The shorter timeout sets it: a quiet rank that reports
    progress must not look hung between two frames."""
    shortest = min(heartbeat_timeout, hang_timeout or heartbeat_timeout)
    return min(limits.BEATS_EVERY_MAX,
               max(RANK_HEARTBEAT_INTERVAL, shortest / limits.BEATS_PER_TIMEOUT))


def worker_devices(
    worker: WorkerSpec, resolved: Mapping[str, Sequence[int]]
) -> list[Optional[int]]:
    """One entry per rank of the worker: a GPU index, or None for a CPU rank."""
    if worker.nproc is not None:
        return [None] * worker.nproc
    if worker.local_devices == "all":
        if worker.host not in resolved:
            raise ValueError(f"host {worker.host!r}: local_devices 'all' was not resolved")
        return list(resolved[worker.host])
    assert isinstance(worker.local_devices, tuple)
    return list(worker.local_devices)


def cluster_key(cluster: ClusterSpec) -> str:
    """A stable id of the cluster file, so a launch finds its predecessors' leftovers,
    unless the cluster names its own (a Slurm launch: its job, so a later job on the same
    nodes never sweeps this one's; ``fdl-fabric run``: each run its own)."""
    if cluster.key is not None:
        return cluster.key
    path = os.path.join(cluster.folder, os.path.basename(cluster.file))
    return hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]


def bind_loopback(cluster: ClusterSpec) -> bool:
    """The coordinator binds loopback when no worker needs to dial it over the network."""
    return all(w.is_local or w.tunnel for w in cluster.workers)


def coordinator_bind_host(cluster: ClusterSpec) -> str:
    """Where the coordinator listens: loopback when no worker dials it over the network
    (every remote worker tunneled), else ``controller.host``. The one copy of that rule."""
    return "127.0.0.1" if bind_loopback(cluster) else cluster.controller.host


def controller_dial_host(cluster: ClusterSpec, worker: WorkerSpec) -> str:
    if worker.tunnel or (worker.is_local and bind_loopback(cluster)):
        return "127.0.0.1"
    return cluster.controller.host


def build_plan(
    cluster: ClusterSpec,
    *,
    argv: Sequence[str],
    run_id: str,
    salt: bytes,
    resolved_devices: Optional[Mapping[str, Sequence[int]]] = None,
    prebuilt: Optional[Mapping[str, PrebuiltBinary]] = None,
    launcher_env: Optional[Mapping[str, str]] = None,
    attempt: int = 0,
) -> LaunchPlan:
    """Number ranks in roster order and compute each one's env and command.

    A rank's environment, lowest precedence first: its host's own (the launcher's for
    local ranks, the SSH login environment for remote ones: the agent's), then
    ``env_forward`` (launcher variables carried over), the launcher's own variables
    below, the cluster ``env``, the host ``env``.
    """
    resolved = resolved_devices or {}
    prebuilt = prebuilt or {}
    environ = os.environ if launcher_env is None else launcher_env
    _check_prebuilt_hosts(cluster, prebuilt)

    devices_by_worker = [worker_devices(w, resolved) for w in cluster.workers]
    world_size = _world_size(devices_by_worker)
    master_addr = _master_addr(cluster, devices_by_worker)
    loopback = bind_loopback(cluster)
    run = _RunFacts(
        cluster=cluster,
        run_id=run_id,
        cluster_id=cluster_key(cluster),
        world_size=world_size,
        workers_with_ranks=sum(1 for d in devices_by_worker if d),
        master_addr=master_addr,
        attempt=attempt,
        environ=environ,
        settings_env=_launcher_settings_env(environ),
    )
    ranks, envelopes = _plan_workers(run, devices_by_worker, salt, prebuilt, argv)
    _declare_secrets(cluster, ranks)
    return LaunchPlan(
        cluster=cluster,
        run_id=run_id,
        salt=salt,
        ranks=tuple(ranks),
        envelopes=envelopes,
        bind_loopback=loopback,
        attempt=attempt,
        launcher_sets=frozenset(k for k in OMP_DEFAULT if k in environ),
    )


@dataclass(frozen=True)
class _RunFacts:
    """What every rank of one plan shares, computed once in `build_plan` so the per-worker
    and per-rank helpers take one argument for it instead of eight."""

    cluster: ClusterSpec
    run_id: str
    cluster_id: str
    world_size: int
    workers_with_ranks: int
    master_addr: str
    attempt: int
    #: The launcher's environment: the source of ``env_forward`` and `FORWARDED_ENV`.
    environ: Mapping[str, str]
    #: `FORWARDED_ENV` as the launcher has them (`_launcher_settings_env`), read once.
    settings_env: Mapping[str, str]


def _declare_secrets(cluster: ClusterSpec, ranks: Sequence[RankPlan]) -> None:
    """The values ``secret_env`` names, as the ranks get them (``env_forward`` brings
    the launcher's), are secrets wherever they appear from now on (`masking.declare`).
    The plan keeps the real values: the agents' specs carry them to the ranks, and
    nothing that shows or keeps a plan does so without `masking`."""
    names = cluster.secret_env
    if names:
        masking.declare(names, {value for r in ranks for key, value in r.env.items()
                                if any(fnmatch.fnmatchcase(key, n) for n in names)})


def _check_prebuilt_hosts(cluster: ClusterSpec, prebuilt: Mapping[str, PrebuiltBinary]) -> None:
    """A prebuilt binary for a host the cluster does not have means the build step and the
    cluster file disagree; refusing beats silently running the fallback program."""
    for host in prebuilt:
        if host not in {w.host for w in cluster.workers}:
            raise ValueError(f"prebuild envelope names host {host!r}, which is not in the cluster")


def _world_size(devices_by_worker: Sequence[Sequence[Optional[int]]]) -> int:
    """The number of ranks across all workers; a launch without any has nothing to run (and
    no rank 0 to take ``MASTER_ADDR`` from), so it is refused here."""
    world_size = sum(len(d) for d in devices_by_worker)
    if world_size == 0:
        raise ValueError("the cluster has no ranks")
    return world_size


def _master_addr(
    cluster: ClusterSpec, devices_by_worker: Sequence[Sequence[Optional[int]]]
) -> str:
    """``MASTER_ADDR`` is where rank 0 runs: the address of the first worker that has ranks
    (a ``local_devices: all`` host may have resolved to none)."""
    return next(w.addr for w, d in zip(cluster.workers, devices_by_worker) if d)


def _plan_workers(
    run: _RunFacts,
    devices_by_worker: Sequence[Sequence[Optional[int]]],
    salt: bytes,
    prebuilt: Mapping[str, PrebuiltBinary],
    argv: Sequence[str],
) -> tuple[list[RankPlan], dict[str, SlimEnvelope]]:
    """Number the ranks in roster order, worker by worker, and build each worker's ranks and
    envelope; a worker without ranks takes no rank numbers and gets no envelope."""
    ranks: list[RankPlan] = []
    envelopes: dict[str, SlimEnvelope] = {}
    next_rank = 0
    for worker, devices in zip(run.cluster.workers, devices_by_worker):
        if not devices:
            continue
        worker_ranks = tuple(range(next_rank, next_rank + len(devices)))
        next_rank += len(devices)
        envelopes[worker.host] = _worker_envelope(run, worker, worker_ranks, devices, salt)
        ranks.extend(_worker_rank_plans(
            run, worker, worker_ranks, devices, prebuilt.get(worker.host), argv
        ))
    return ranks, envelopes


def _worker_envelope(
    run: _RunFacts,
    worker: WorkerSpec,
    worker_ranks: tuple[int, ...],
    devices: Sequence[Optional[int]],
    salt: bytes,
) -> SlimEnvelope:
    """The envelope one worker's ranks receive: the run as that worker sees it, with the
    controller address it must dial (loopback when tunneled) rather than the controller's."""
    gpu_list = tuple(d for d in devices if d is not None)
    return SlimEnvelope(
        run_id=run.run_id,
        controller_host=controller_dial_host(run.cluster, worker),
        controller_port=run.cluster.controller.port,
        world_size=run.world_size,
        num_workers=run.workers_with_ranks,
        host=worker.host,
        ranks=worker_ranks,
        local_devices=gpu_list if worker.nproc is None else None,
        nccl_socket_ifname=worker.nccl_socket_ifname,
        path=worker.path,
        salt=salt,
    )


def is_interpreter(word: str) -> bool:
    """Whether a command's first word is the Python interpreter ``python:`` replaces: its
    basename is ``python``, ``python3`` or ``python3.N``, or it is the launcher's own
    interpreter (what ``fdl-fabric run`` writes, whatever its name: ``pypy3``...)."""
    return bool(_INTERPRETER_RE.fullmatch(os.path.basename(word))) or (
        bool(sys.executable) and word == sys.executable)


def interpreter(cluster: ClusterSpec, worker: WorkerSpec) -> Optional[str]:
    """The ``python:`` of a worker's ranks: its own, else the cluster's, else None (the
    command's own first word stays)."""
    return worker.python or cluster.python


def with_interpreter(argv: Sequence[str], python: Optional[str]) -> tuple[str, ...]:
    """``argv`` with its interpreter replaced by ``python`` when it starts with one
    (`is_interpreter`); any other command is left as it is. A relative ``python`` with a
    slash (``.venv/bin/python``) is kept relative: the agent execs it after entering the
    ranks' folder, so it names the same file on every host, relative to that folder."""
    if python is None or not argv or not is_interpreter(argv[0]):
        return tuple(argv)
    return (python, *argv[1:])


def interpreted_argv(cluster: ClusterSpec, worker: WorkerSpec,
                     argv: Sequence[str]) -> tuple[str, ...]:
    """What a worker's ranks run, before any prebuilt binary: ``argv`` with the worker's
    interpreter. The pre-flight checks this same command (the file it resolves to, the
    script or module it runs), so it checks what will run."""
    return with_interpreter(argv, interpreter(cluster, worker))


def _worker_command(
    cluster: ClusterSpec, worker: WorkerSpec, entry: Optional[PrebuiltBinary],
    argv: Sequence[str]
) -> tuple[str, tuple[str, ...]]:
    """The cwd and argv of a worker's ranks: a prebuilt binary replaces the program (keeping
    its arguments) and may move the cwd; without one the ranks run ``argv`` in ``path``,
    through the worker's ``python:`` when the command starts with an interpreter."""
    cwd = entry.cwd(worker.path) if entry else worker.path
    rank_argv = (entry.program(worker.path), *argv[1:]) if entry else \
        interpreted_argv(cluster, worker, argv)
    return cwd, rank_argv


def _worker_rank_plans(
    run: _RunFacts,
    worker: WorkerSpec,
    worker_ranks: tuple[int, ...],
    devices: Sequence[Optional[int]],
    entry: Optional[PrebuiltBinary],
    argv: Sequence[str],
) -> list[RankPlan]:
    """One worker's ranks, in local-rank order: they share the command, and differ only in
    their rank numbers and device, hence in their environment."""
    cwd, rank_argv = _worker_command(run.cluster, worker, entry, argv)
    layers = _worker_layers(run, worker, entry)
    return [
        RankPlan(
            rank=rank,
            local_rank=local_rank,
            worker=worker,
            device=device,
            cwd=cwd,
            argv=rank_argv,
            env=_rank_env(run, worker, rank, local_rank, device, len(devices), layers),
        )
        for local_rank, (rank, device) in enumerate(zip(worker_ranks, devices))
    ]


def _rank_env(
    run: _RunFacts,
    worker: WorkerSpec,
    rank: int,
    local_rank: int,
    device: Optional[int],
    local_world_size: int,
    layers: tuple[dict[str, str], dict[str, str]],
) -> dict[str, str]:
    """One rank's environment from the file and the launcher, layered lowest precedence
    first (see `build_plan`) so that the user's ``env`` always has the last word: the
    worker's layers below and above the rank's own (`_worker_layers`)."""
    below, above = layers
    env = dict(below)
    env.update(_torchrun_env(run, worker, rank, local_rank, local_world_size))
    env.update(_device_env(device))
    env.update(above)
    return env


def _worker_layers(run: _RunFacts, worker: WorkerSpec, entry: Optional[PrebuiltBinary]
                   ) -> tuple[dict[str, str], dict[str, str]]:
    """What every rank of ``worker`` shares below its own variables (``env_forward``) and
    above them (the launcher's settings, the interface, the library path, the cluster's
    and the worker's ``env``), merged once per worker: at 8,192 ranks, reading the
    launcher's environment for each rank was a tenth of the plan's time (issue 35)."""
    cluster = run.cluster
    below = forwarded_env(run.environ, (*cluster.env_forward, *worker.env_forward))
    above = dict(run.settings_env)
    above.update(_socket_ifname_env(worker))
    # Ranks write to pipes; without this Python buffers their output
    # for minutes. User env may turn it off.
    above["PYTHONUNBUFFERED"] = "1"
    above.update(_prebuilt_library_env(cluster, worker, entry))
    above.update(cluster.env)
    above.update(worker.env)
    return below, above


def _torchrun_env(
    run: _RunFacts, worker: WorkerSpec, rank: int, local_rank: int, local_world_size: int
) -> dict[str, str]:
    """The variables torchrun sets for a rank, plus the launcher's own identity ones: a
    training script written for torchrun must run unchanged under fdl-fabric."""
    return {
        ENV_LOCAL_RANK: str(local_rank),
        ENV_HOST_NAME: worker.host,
        ENV_RUN_ID: run.run_id,
        ENV_CLUSTER_KEY: run.cluster_id,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(run.world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(worker.index),
        "GROUP_WORLD_SIZE": str(run.workers_with_ranks),
        "ROLE_NAME": ROLE_NAME,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(run.world_size),
        "MASTER_ADDR": run.master_addr,
        "MASTER_PORT": str(run.cluster.master_port),
        "TORCHELASTIC_RUN_ID": run.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(run.attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(run.cluster.elastic.max_restarts),
    }


def _device_env(device: Optional[int]) -> dict[str, str]:
    """Pin a GPU rank to its one device, numbered as ``nvidia-smi`` numbers them (PCI bus
    order, CUDA's default being fastest-first); a CPU rank gets no pin."""
    if device is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(device), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _launcher_settings_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`FORWARDED_ENV` as set (non-empty) where the launcher runs, so verbosity and network
    timeouts chosen for the launch also apply to the ranks, on every host."""
    return {key: environ[key] for key in FORWARDED_ENV if environ.get(key)}


def _socket_ifname_env(worker: WorkerSpec) -> dict[str, str]:
    """``nccl_socket_ifname`` names the interface for both NCCL and Gloo: they would
    otherwise pick their own, possibly one the other hosts cannot reach."""
    if not worker.nccl_socket_ifname:
        return {}
    return {
        "NCCL_SOCKET_IFNAME": worker.nccl_socket_ifname,
        "GLOO_SOCKET_IFNAME": worker.nccl_socket_ifname,
    }


def _prebuilt_library_env(
    cluster: ClusterSpec, worker: WorkerSpec, entry: Optional[PrebuiltBinary]
) -> dict[str, str]:
    """A prebuilt binary needs its libraries found, unless the user set ``LD_LIBRARY_PATH``
    in the cluster or worker ``env``: theirs wins, and is applied later anyway."""
    user_ld = "LD_LIBRARY_PATH" in cluster.env or "LD_LIBRARY_PATH" in worker.env
    if entry and not user_ld:
        return {"LD_LIBRARY_PATH": entry.ld_library_path}
    return {}


def forwarded_env(environ: Mapping[str, str], patterns: Sequence[str]) -> dict[str, str]:
    """The launcher variables ``env_forward`` names (globs allowed), reserved ones skipped."""
    if not patterns:
        return {}
    return {k: v for k, v in environ.items()
            if not is_reserved_env_key(k) and any(fnmatch.fnmatchcase(k, p) for p in patterns)}

"""`LaunchOptions`: what the one options builder (`options.launch_options`) makes of the
flags of a launch, and what the launch (`launch.Launch`) runs.

A module of its own, importing nothing heavy: the front of a ``--detach`` builds the
options and hands them to the supervisor's interpreter (`detach`), and must not pay for
the launcher's imports (Fabric, paramiko) that the supervisor pays beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..clusterfile import ClusterSpec
from ..events import Event
from ..supervision.policy import MaxFailure


@dataclass
class LaunchOptions:
    cluster_file: Optional[str] = "cluster.yml"
    command: Optional[str] = None
    argv: Sequence[str] = ()
    kill_grace: Optional[float] = None
    verbosity: int = 1
    quiet: bool = False
    #: ``--max-failure``, parsed (`flags.max_failure`); None: the cluster file's applies.
    max_failure: MaxFailure = None
    log_dir: Optional[str] = None
    dry_run: bool = False
    env_overrides: dict[str, str] = field(default_factory=dict)
    preflight: bool = True
    #: ``--smoke``: the fleet check (reachability, a collective) before the first attempt.
    smoke: bool = False
    max_restarts: Optional[int] = None
    #: A cluster built in code (``fdl-fabric run``) instead of ``cluster_file``.
    cluster: Optional[ClusterSpec] = None
    #: ``--slurm``: the workers are the nodes of the allocation this runs in. Without a
    #: ``cluster_file`` no file is read: the flags say everything.
    slurm: bool = False
    #: ``--nproc-per-node``: ranks on each Slurm node (wins over the file's).
    nproc_per_node: Optional[int] = None
    #: ``--json``: every event as a JSON line on stdout (`output.JsonConsole`).
    json: bool = False
    #: Called with every event (the Python API's ``on_event``); must not raise.
    on_event: Optional[Callable[[Event], None]] = None
    #: ``--agent-timeout``: seconds of silence after which a host is unresponsive.
    agent_timeout: Optional[float] = None
    #: ``--hang-timeout``: seconds without output or progress after which the run is
    #: hung (0: never).
    hang_timeout: Optional[float] = None
    #: ``--fanout``: hosts reached directly; beyond it, a gateway tree (wins over the file's).
    fanout: Optional[int] = None
    #: ``--on-exit``: a shell command run once when the run ends (wins over the file's).
    on_exit: Optional[str] = None
    #: ``--detach``: asked for (`commands.detach` starts the supervisor that runs it).
    detach: bool = False
    #: This process is the detached supervisor of the run (`commands.supervise`).
    detached: bool = False
    #: The run id, when chosen before the launch (``--detach`` names it at once).
    run_id: Optional[str] = None
    #: ``--sync`` True, ``--no-sync`` False; None: as the cluster file says (``sync:``).
    sync: Optional[bool] = None
    #: ``--python``: every host's interpreter for the ranks (wins over the file's).
    python: Optional[str] = None
    #: ``--trust-ssh-config``: the ssh_config a cluster file names may run commands
    #: (``ProxyCommand``, ``Match exec``...; `transport.configtrust`).
    trust_ssh_config: bool = False


__all__ = ["LaunchOptions", "MaxFailure"]

"""The fast pre-flight of a launch: what each host's agent checks before any rank starts.

The agent gathers the facts on the launch's own session (`fdl_fabric.agent.checks`), asked
with the same `probe.agent_checks` as prebuild-check's agents; this says what to look at
and judges the answers with the same `verdicts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from ..clusterfile import ClusterSpec, WorkerSpec
from ..planning.envelope import PrebuiltBinary
from ..planning.plan import controller_dial_host, coordinator_bind_host
from .facts import ControllerFacts, HostFacts
from .probe import Dial, HostPlan, agent_checks, settings_of
from .report import Check
from .verdicts import evaluate

__all__ = ["agent_checks", "judge", "launch_plan"]


def launch_plan(cluster: ClusterSpec, worker: WorkerSpec, argv: Sequence[str],
                prebuilt: Optional[PrebuiltBinary],
                master: Optional[tuple[str, int]] = None) -> HostPlan:
    """What a launch checks on one host before any rank starts (``fast``); ``master``:
    ``MASTER_ADDR``/``MASTER_PORT``, which every host's ranks dial."""
    dial_host = controller_dial_host(cluster, worker)
    bind_host = coordinator_bind_host(cluster)
    port = cluster.controller.port
    dial = Dial(host=dial_host, port=port, token="", tunnel=worker.tunnel,
                listen_host=bind_host, listen_port=port, configured_port=port)
    return HostPlan(worker=worker, fast=True, argv=tuple(argv), prebuilt=prebuilt, dial=dial,
                    path_env=worker.env.get("PATH", cluster.env.get("PATH")),
                    python_path=worker.env.get("PYTHONPATH", cluster.env.get("PYTHONPATH")),
                    master=master, ifnames=settings_of(cluster, worker))


def judge(plan: HostPlan, values: Mapping[str, str]) -> list[Check]:
    """The verdict rows of an agent's facts (the same rules as `inv prebuild-check`)."""
    assert plan.dial is not None
    ctl = ControllerFacts(bind_host=plan.dial.listen_host, port=plan.dial.configured_port)
    return evaluate(plan, HostFacts(values=dict(values)), ctl)

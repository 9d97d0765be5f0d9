"""The collective smoke test (``prebuild-check --smoke``, ``inv launch --smoke``): every
rank slot of the plan runs a tiny torch.distributed program, through the hosts' agents
(`fdl_fabric.agent.smokerun`), before a single rank of the job starts.

A multi-node job that hangs at init is the loudest failure there is, and its cause
(a port, an interface, a peer without torch, a GPU) is named nowhere. Here each slot
runs exactly what a rank's first seconds do, with that rank's environment
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``CUDA_VISIBLE_DEVICES``,
the socket interfaces, the user's ``env``...) and interpreter: ``init_process_group``
on the run's backend, one all-reduce checked for the right sum, one barrier. What
fails is named: the host, the rank and the error's last line.

The bound: `SMOKE_TIMEOUT` (30 s) in all, as the launcher sees it. Each host's agent
kills its slots `ANSWER_MARGIN` (5 s) before that, which leaves the answers time to come
back; each slot's own collective timeout ends `smokerun.COLLECTIVE_SLACK` (3 s) before
the agent's bound, so a slot whose peer never came says so in torch's words
("waiting for clients. 3/4 clients joined") instead of being killed. 30 s covers a
cold import of a CUDA torch (a few seconds) on every host with room to spare; on a
host with fewer cores than slots the imports queue (about 1.4 CPU-s each for torch 2.13
CPU), so pass a larger ``timeout`` there.

The backend is the run's: NCCL when every rank has a GPU (workers with
``local_devices``), gloo otherwise (a cluster mixing CPU and GPU ranks cannot use NCCL).

Skipped when torch is not importable by the ranks' interpreter on any host: one WARN
row (on the controller's line: it is said of the fleet, not of one host), because
nothing was tested though the user asked, yet a job that does not use torch is not
wrong. When only some hosts lack it, their slots FAIL: the others would wait for them.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from typing import Any

from .. import reports
from ..planning.plan import LaunchPlan, RankPlan, interpreter, is_interpreter
from ..transport.session import AgentSession
from .answers import collect
from .report import CONTROLLER, Check, Status

#: The bound of the whole smoke test, as the launcher waits for it (seconds).
SMOKE_TIMEOUT = 30.0
#: Of the bound, what is kept for the answers' way back: the agents kill their slots
#: this much earlier.
ANSWER_MARGIN = 5.0
#: The row's name in the report.
NAME = "smoke"
#: Hosts named in the skip line before "and N more".
_NAMED_HOSTS = 3


def backend(plan: LaunchPlan) -> str:
    """``nccl`` when every rank has a GPU, else ``gloo``."""
    return "nccl" if all(r.device is not None for r in plan.ranks) else "gloo"


def slot_python(rank: RankPlan, plan: LaunchPlan) -> str:
    """The ranks' interpreter: their command's first word when it is one (``python:``
    already applied), else the worker's ``python:``, else ``python3`` (a binary's ranks
    would import torch, if at all, through the host's Python)."""
    if rank.argv and is_interpreter(rank.argv[0]):
        return rank.argv[0]
    return interpreter(plan.cluster, rank.worker) or "python3"


def requests(plan: LaunchPlan, timeout: float = SMOKE_TIMEOUT) -> dict[str, dict[str, Any]]:
    """Each host's smoke request: its slots' environments split as `LaunchPlan.agent_spec`
    splits them (``env`` shared by the host's ranks, each slot's own besides), the
    ``defaults``, the interpreter and the ranks' folder, the backend, and the agent's
    bound (``timeout`` less `ANSWER_MARGIN`). No envelope: the program never dials the
    coordinator."""
    if timeout <= ANSWER_MARGIN + 1:
        raise ValueError(f"the smoke test's timeout must exceed {ANSWER_MARGIN + 1:g} s")
    chosen = backend(plan)
    out: dict[str, dict[str, Any]] = {}
    for host in plan.hosts():
        ranks = plan.host_ranks(host)
        common = dict(ranks[0].env)
        for r in ranks[1:]:
            common = {k: v for k, v in common.items() if r.env.get(k) == v}
        out[host] = {
            "python": slot_python(ranks[0], plan), "cwd": ranks[0].cwd, "env": common,
            "slots": [{"rank": r.rank, "env": {k: v for k, v in r.env.items()
                                                if k not in common}} for r in ranks],
            "defaults": plan.defaults(host), "backend": chosen,
            "timeout": timeout - ANSWER_MARGIN,
        }
    return out


def run_smoke(plan: LaunchPlan, sessions: Mapping[str, AgentSession],
              inbox: queue.SimpleQueue[reports.Report],
              timeout: float = SMOKE_TIMEOUT) -> list[Check]:
    """Send each host its request, collect the answers within ``timeout``, judge them.

    ``sessions``: the hosts' started agents (a launch's, or prebuild-check's); their
    reports arrive on ``inbox``, where whatever is not a smoke answer is put back. A
    host without a session, or whose agent ends first, is a FAIL row: never raises for
    a host's sake."""
    asked = requests(plan, timeout)
    answers: dict[str, dict[str, Any]] = {}
    for host, request in asked.items():
        if host in sessions:
            sessions[host].send_probe({"smoke": request})
        else:
            answers[host] = {"error": "no agent to run it"}
    answers.update(_collect([h for h in asked if h not in answers], inbox, timeout))
    return judge(plan, answers)


def _collect(hosts: Sequence[str], inbox: queue.SimpleQueue[reports.Report],
             timeout: float) -> dict[str, dict[str, Any]]:
    """The smoke answers of ``hosts`` from ``inbox``, or why there is none, by
    ``timeout``; the other reports are put back, in their order."""
    return collect(hosts, inbox, timeout, lambda r: getattr(r, "smoke", None))


def judge(plan: LaunchPlan, answers: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """The smoke rows from each host's answer (`smokerun.run`'s, or ``{"error": why}``):
    per host an ok row with the time, or a FAIL row per failing slot; a FAIL for a host
    without an answer; one WARN when every slot of every host found no torch."""
    hosts = plan.hosts()
    given = {h: answers.get(h) or {"error": "no answer"} for h in hosts}
    slots = {h: _slots(plan, h, given[h]) for h in hosts}
    everyone_answered = not any("error" in a for a in given.values())
    if everyone_answered and all(s.get("skipped") for h in hosts for s in slots[h]):
        return [Check(CONTROLLER, NAME, Status.WARN, _skip_line(plan, answers))]
    no_torch = [int(s["rank"]) for h in hosts for s in slots[h] if s.get("skipped")]
    return [row for h in hosts for row in _host_rows(plan, h, given[h], slots[h], no_torch)]


def _host_rows(plan: LaunchPlan, host: str, answer: Mapping[str, Any],
               slots: Sequence[Mapping[str, Any]], no_torch: Sequence[int]) -> list[Check]:
    """One host's rows: its FAIL when it did not answer, else a FAIL per failed slot,
    else its ok row."""
    if "error" in answer:
        return [Check(host, NAME, Status.FAIL, f"{_ranks(plan, host)}: {answer['error']}")]
    failed = [s for s in slots if not s.get("ok")]
    if failed:
        return [Check(host, NAME, Status.FAIL, f"rank {s['rank']}: {_why(s, no_torch)}")
                for s in failed]
    return [Check(host, NAME, Status.OK, _passed(plan, host, answer, slots))]


def _slots(plan: LaunchPlan, host: str, answer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The answer's slot entries in the plan's rank order, one per rank of the host; a
    rank the answer leaves out is a failed slot."""
    given = {int(s["rank"]): s for s in answer.get("slots") or [] if isinstance(s, dict)
             and "rank" in s}
    return [given.get(r.rank) or {"rank": r.rank, "ok": False,
                                  "error": "the agent's answer has no entry for it"}
            for r in plan.host_ranks(host)]


def _why(slot: Mapping[str, Any], no_torch: Sequence[int]) -> str:
    """A failed slot's reason; a slot that failed while others had no torch says whom it
    was most likely waiting for."""
    if slot.get("skipped"):
        return (f"torch is not importable by the ranks' interpreter ({slot['skipped']}), "
                "where other ranks' is: the job would wait for this rank")
    why = str(slot.get("error") or "failed, without saying why")
    if no_torch:
        return f"{why} (likely waiting for {_numbers(no_torch)}, which cannot import torch)"
    return why


def _passed(plan: LaunchPlan, host: str, answer: Mapping[str, Any],
            slots: Sequence[Mapping[str, Any]]) -> str:
    """``ranks 0-7 all-reduced and passed the barrier in 2.1 s (gloo; collective 0.3 s)``:
    the slowest slot from its start, and the slowest init + all-reduce + barrier."""
    took = max((float(s.get("seconds") or 0) for s in slots), default=0.0)
    collective = max((float(s.get("collective") or 0) for s in slots), default=0.0)
    return (f"{_ranks(plan, host)} all-reduced and passed the barrier in {took:.1f} s "
            f"({answer.get('backend') or backend(plan)}; init, all-reduce and barrier "
            f"{collective:.1f} s)")


def _ranks(plan: LaunchPlan, host: str) -> str:
    return _numbers([r.rank for r in plan.host_ranks(host)])


def _numbers(numbers: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0, 1``, ``ranks 0-7, 16-23``: runs of consecutive ranks."""
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    if len(numbers) == 2:
        return f"ranks {numbers[0]}, {numbers[1]}"
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "ranks " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else
                                ", ".join(map(str, r)) for r in runs)


def _skip_line(plan: LaunchPlan, answers: Mapping[str, Mapping[str, Any]]) -> str:
    """One line for the whole fleet, each interpreter named with its hosts, and what the
    first host's interpreter said."""
    by_python: dict[str, list[str]] = {}
    for host in plan.hosts():
        by_python.setdefault(str(answers[host].get("python") or "?"), []).append(host)
    where = [f"{python} on {_some(hosts) if len(by_python) > 1 else 'every host'}"
             for python, hosts in by_python.items()]
    said = [str(s["skipped"]) for s in answers[plan.hosts()[0]].get("slots") or []
            if isinstance(s, dict) and s.get("skipped")]
    why = said[0].rpartition(": ")[2] if said else ""
    return ("smoke test skipped: torch is not importable by the ranks' interpreter ("
            + "; ".join(where) + (f": {why}" if why else "") + ")")


def _some(hosts: Sequence[str]) -> str:
    if len(hosts) <= _NAMED_HOSTS:
        return ", ".join(hosts)
    return ", ".join(hosts[:_NAMED_HOSTS]) + f" and {len(hosts) - _NAMED_HOSTS} more"


__all__ = ["ANSWER_MARGIN", "SMOKE_TIMEOUT", "backend", "judge", "requests", "run_smoke"]

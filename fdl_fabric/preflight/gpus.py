"""The GPU verdicts: the ``gpus`` row (nvidia-smi lists what ``local_devices`` wants, and
who else holds it) and the GPU health rows; pure, from what the host's agent gathered
(`fdl_fabric.agent.gpus`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from .facts import HostFacts
from .probe import HostPlan
from .report import Check, Status


def _parse_csv_lines(text: str) -> list[list[str]]:
    return [[f.strip() for f in line.split(",")] for line in text.split(";") if line.strip()]


def gpus_row(plan: HostPlan, facts: HostFacts, ctl: object) -> Optional[Check]:
    """The ``gpus`` row (only with ``local_devices``): nvidia-smi ran, lists every GPU
    the worker wants, and no other compute process holds one of them (it would share the
    GPU's memory with a rank)."""
    if plan.worker.local_devices is None:
        return None
    v = facts.values
    listing = v.get("gpus", "")
    failed = _nvidia_smi_failure(plan, v.get("gpu_rc", ""), listing)
    if failed is not None:
        return failed
    found, uuid_to_index = _listed_gpus(listing)
    absent = _absent_gpus(plan, found)
    if absent is not None:
        return absent
    used = _used_gpus(plan, found)
    busy = _busy_gpus(v.get("gpu_apps", ""), uuid_to_index, used)
    return _gpus_in_use_row(plan, used, busy)


def _nvidia_smi_failure(plan: HostPlan, rc: str, listing: str) -> Optional[Check]:
    """The FAIL row when nvidia-smi is absent or failed (its listing is then no evidence
    either way), else None. ``rc`` is the agent's ``gpu_rc``: an exit status, ``missing``
    or ``error``; on failure ``listing`` holds what nvidia-smi printed instead."""
    if rc == "missing":
        return Check(plan.host, "gpus", Status.FAIL,
                     "local_devices is set but nvidia-smi is not on this host's PATH")
    if rc != "0":
        first = (listing.split(";")[0] or "no output")[:120]
        return Check(plan.host, "gpus", Status.FAIL, f"nvidia-smi failed (status {rc}): {first}")
    return None


def _listed_gpus(listing: str) -> tuple[list[int], dict[str, int]]:
    """The GPU indices nvidia-smi listed, in its order, and each listed UUID's index.

    The UUIDs are kept because nvidia-smi names a compute process's GPU by UUID, while
    ``local_devices`` names GPUs by index. Lines that do not start with an index (a
    warning nvidia-smi mixed in) are skipped.
    """
    uuid_to_index: dict[str, int] = {}
    found: list[int] = []
    for fields in _parse_csv_lines(listing):
        if fields and fields[0].isdigit():
            found.append(int(fields[0]))
            if len(fields) > 1:
                uuid_to_index[fields[1]] = int(fields[0])
    return found, uuid_to_index


def _absent_gpus(plan: HostPlan, found: list[int]) -> Optional[Check]:
    """The FAIL row when a GPU the worker wants is not listed (for ``all``: none is
    listed), else None: ranks pinned to an absent GPU fail only once started."""
    wanted = plan.worker.local_devices
    if wanted == "all":
        if not found:
            return Check(plan.host, "gpus", Status.FAIL,
                         "local_devices: all, but nvidia-smi lists no GPU")
        return None
    assert isinstance(wanted, tuple)
    missing = [d for d in wanted if d not in found]
    if missing:
        listed = ", ".join(str(i) for i in found) or "none"
        names = ", ".join(str(d) for d in missing)
        return Check(plan.host, "gpus", Status.FAIL,
                     f"GPU {names} not found (nvidia-smi lists {listed})")
    return None


def _used_gpus(plan: HostPlan, found: list[int]) -> list[int]:
    """The GPUs the worker's ranks will use: every listed one for ``local_devices: all``,
    else those named (all present, `_absent_gpus` has checked)."""
    wanted = plan.worker.local_devices
    if wanted == "all":
        return found
    assert isinstance(wanted, tuple)
    return list(wanted)


def _busy_gpus(apps: str, uuid_to_index: Mapping[str, int],
               used: list[int]) -> dict[int, list[str]]:
    """Pids of the compute processes (the agent's ``gpu_apps``: ``uuid, pid`` lines) on
    each used GPU that has any. A GPU the worker does not use may be busy: not our
    concern. A line without a pid still counts, as pid ``?``."""
    busy: dict[int, list[str]] = {}
    for fields in _parse_csv_lines(apps):
        index = uuid_to_index.get(fields[0]) if fields else None
        if index is not None and index in used:
            busy.setdefault(index, []).append(fields[1] if len(fields) > 1 else "?")
    return busy


def _gpus_in_use_row(plan: HostPlan, used: list[int], busy: Mapping[int, list[str]]) -> Check:
    """OK when the used GPUs are free; only WARN when one is busy: sharing a GPU may be
    intended, and the ranks can still start."""
    gpus = ", ".join(str(i) for i in used)
    if busy:
        detail = "; ".join(f"GPU {i}: pid {', '.join(p)}" for i, p in sorted(busy.items()))
        return Check(plan.host, "gpus", Status.WARN,
                     f"GPU {gpus} present, but busy with compute processes ({detail})")
    return Check(plan.host, "gpus", Status.OK, f"GPU {gpus} present, no compute process")


def health_rows(plan: HostPlan, facts: HostFacts, ctl: object) -> list[Check]:
    """The GPU health rows (only with ``local_devices``), one per GPU and field that is
    not healthy, from what `fdl_fabric.agent.gpus.gather` found."""
    return []

"""The GPU verdicts: the ``gpus`` row (nvidia-smi lists what ``local_devices`` wants, and
who else holds it) and the ``gpu_health`` rows; pure, from what the host's agent gathered
(`fdl_fabric.agent.gpus`), parsed here from nvidia-smi's own formats: the ``--query-gpu``
CSV (with its header), ``nvidia-smi -q`` (per GPU, by PCI address), the plain table (where
a crashed GPU reads ``ERR!``), ``dmesg``'s Xid lines, and the matmul program's JSON line.

Other processes on a used GPU are said once: by the ``gpus`` row (pids and memory) in
prebuild-check, by a ``gpu_health`` warning in a launch's pre-flight, which has no
``gpus`` row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional

from .facts import HostFacts
from .probe import HostPlan
from .report import Check, Status


def _parse_csv_lines(text: str) -> list[list[str]]:
    return [[f.strip() for f in line.split(",")] for line in text.split(";") if line.strip()]


def gpus_row(plan: HostPlan, facts: HostFacts, ctl: object) -> Optional[Check]:
    """The ``gpus`` row (only with ``local_devices``): nvidia-smi ran, lists every GPU
    the worker wants, and no other compute process holds one of them (it would share the
    GPU's memory with a rank: named with its pid and the memory it holds)."""
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
    """The compute processes (the agent's ``gpu_apps``: ``uuid, pid, used memory`` lines)
    on each used GPU that has any, as ``pid (memory)``. A GPU the worker does not use may
    be busy: not our concern. A line without a pid still counts, as pid ``?``; memory
    nvidia-smi cannot tell (``[N/A]``) is left out."""
    busy: dict[int, list[str]] = {}
    for fields in _parse_csv_lines(apps):
        index = uuid_to_index.get(fields[0]) if fields else None
        if index is not None and index in used:
            busy.setdefault(index, []).append(_pid_words(fields))
    return busy


def _pid_words(fields: list[str]) -> str:
    """``4242 (2566 MiB)`` of an ``uuid, pid, used memory`` line."""
    pid = fields[1] if len(fields) > 1 else "?"
    memory = fields[2] if len(fields) > 2 else ""
    return f"{pid} ({memory})" if memory and not memory.startswith("[") else pid


def _gpus_in_use_row(plan: HostPlan, used: list[int], busy: Mapping[int, list[str]]) -> Check:
    """OK when the used GPUs are free; only WARN when one is busy: sharing a GPU may be
    intended, and the ranks can still start."""
    gpus = ", ".join(str(i) for i in used)
    if busy:
        detail = "; ".join(f"GPU {i}: pid {', '.join(p)}" for i, p in sorted(busy.items()))
        return Check(plan.host, "gpus", Status.WARN,
                     f"GPU {gpus} present, but busy with compute processes ({detail})")
    return Check(plan.host, "gpus", Status.OK, f"GPU {gpus} present, no compute process")



# --------------------------------------------------------------------------------------------
# GPU health: the parsers (pure, over nvidia-smi's own formats) and the rows
# --------------------------------------------------------------------------------------------

#: What nvidia-smi prints in place of a value it could not read from the GPU: ``ERR!`` in
#: its table (a crashed GPU, nvidia-smi still exiting 0), ``[Unknown Error]`` in a CSV
#: query, ``Unknown Error`` in ``-q``. ``N/A`` and ``[Not Supported]`` are not errors.
ERROR_MARKS = ("ERR!", "Unknown Error")
#: The ``-q`` sections whose leaves the health rows read (the rest of a full ``-q`` may
#: hold a quirk such as ``Addressing Mode : Unknown Error`` on a healthy 535 driver).
_Q_SECTIONS = frozenset({"ECC Mode", "ECC Errors", "Retired Pages", "Remapped Rows",
                         "Performance State", "Clocks Throttle Reasons",
                         "Clocks Event Reasons"})
#: The clock limits that mean power, heat or the board slowed the GPU (not idle, not an
#: applications-clocks setting, not sync boost). The section is "Clocks Throttle Reasons"
#: up to driver 530 and "Clocks Event Reasons" since 535.
_THROTTLES = frozenset({"SW Power Cap", "HW Slowdown", "HW Thermal Slowdown",
                        "HW Power Brake Slowdown", "SW Thermal Slowdown"})
_CLOCK_SECTIONS = frozenset({"Clocks Throttle Reasons", "Clocks Event Reasons"})
_HEALTH = "gpu_health"
_QUOTE_MAX = 160

PciKey = tuple[int, int, int]
_PCI = re.compile(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})")
_Q_GPU = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")


def pci_key(text: str) -> Optional[PciKey]:
    """``(domain, bus, device)`` of a PCI address however nvidia-smi or the kernel write
    it: ``00000000:83:00.0`` (nvidia-smi), ``0000:9b:00`` (an Xid line)."""
    m = _PCI.search(text)
    return (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)) if m else None


def _pci_words(key: PciKey) -> str:
    return f"{key[0]:04x}:{key[1]:02x}:{key[2]:02x}"


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _QUOTE_MAX else text[:_QUOTE_MAX] + "…"


@dataclass(frozen=True)
class GpuRow:
    """One GPU of the health CSV: its index, PCI address, UUID and every cell by field."""

    index: int
    pci: Optional[PciKey]
    uuid: str
    cells: dict[str, str]


def parse_health_csv(text: str) -> tuple[list[GpuRow], list[str]]:
    """The GPUs of a ``--query-gpu=... --format=csv`` output (fields named by its header,
    units such as `` [MiB]`` dropped), and the lines that are not rows: what nvidia-smi
    said instead (``Unable to determine the device handle for GPU 0000:0B:00.0: Unknown
    Error``)."""
    fields: list[str] = []
    rows: list[GpuRow] = []
    other: list[str] = []
    for line in (ln.strip() for ln in text.splitlines()):
        cells = [c.strip() for c in line.split(",")]
        if not fields and cells and cells[0] == "index":
            fields = [re.sub(r"\s*\[.*\]$", "", c) for c in cells]
        elif fields and cells[0].isdigit() and len(cells) == len(fields):
            named = dict(zip(fields, cells))
            rows.append(GpuRow(int(cells[0]), pci_key(named.get("pci.bus_id", "")),
                               named.get("uuid", ""), named))
        elif line:
            other.append(line)
    return rows, other


def parse_q(text: str) -> dict[PciKey, dict[tuple[str, ...], str]]:
    """``nvidia-smi -q``, per GPU (by PCI address, from its ``GPU 00000000:83:00.0``
    line): every leaf as ``(section, ..., name) -> value``, the path taken from the
    indentation."""
    gpus: dict[PciKey, dict[tuple[str, ...], str]] = {}
    leaves: Optional[dict[tuple[str, ...], str]] = None
    stack: list[tuple[int, str]] = []
    for raw in text.expandtabs(4).splitlines():
        head = _Q_GPU.match(raw)
        if head:
            key = pci_key(head.group(1))
            leaves = gpus.setdefault(key, {}) if key else None
            stack = []
            continue
        if leaves is None or not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip())
        name, sep, value = raw.strip().partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(s for _, s in stack) + (name.strip(),)
        if sep:
            leaves[path] = value.strip()
        else:
            stack.append((indent, name.strip()))
    return gpus


def _table_labels(line: str) -> list[tuple[int, int, int, str]]:
    """The labels of a table header line: ``(cell, start, end, label)``; words one space
    apart are one label (``Volatile Uncorr. ECC``)."""
    out = []
    for cell, m in enumerate(re.finditer(r"[^|]+", line)):
        for w in re.finditer(r"\S+(?: \S+)*", m.group()):
            out.append((cell, m.start() + w.start(), m.start() + w.end(), w.group()))
    return out


def parse_table_errors(text: str) -> dict[int, list[str]]:
    """The fields plain ``nvidia-smi`` shows as ``ERR!``, per GPU index, each named by the
    header label above it (``Name``, ``Fan``, ``Pwr:Usage/Cap``, ``Volatile Uncorr.
    ECC``...). A GPU's lines follow ``|===``; its first line starts with its index."""
    lines = text.splitlines()
    try:
        ruler = next(i for i, ln in enumerate(lines) if ln.startswith("|="))
    except StopIteration:
        return {}
    header = [_table_labels(ln) for ln in lines[ruler - 3:ruler] if ln.startswith("|")]
    found: dict[int, list[str]] = {}
    index, row = -1, 0
    for line in lines[ruler + 1:]:
        if not line.startswith("|"):
            if line.startswith("+"):
                row = 0
                continue
            break
        first = re.match(r"\|\s+(\d+)\s", line)
        if row == 0 and first:
            index = int(first.group(1))
        labels = header[row] if row < len(header) else []
        for m in re.finditer(r"ERR!", line):
            found.setdefault(index, []).append(_nearest(labels, line, m.start(), m.end()))
        row += 1
    return found


def _nearest(labels: list[tuple[int, int, int, str]], line: str, start: int, end: int) -> str:
    """The header label over the span ``start:end`` of a table line: in the same cell,
    the one whose span is nearest (overlapping counts as nearest)."""
    cell = line.count("|", 0, start) - 1
    same = [lb for lb in labels if lb[0] == cell] or labels
    if not same:
        return "a field"
    best = min(same, key=lambda lb: max(lb[1] - end, start - lb[2], 0) + abs(lb[1] - start)
               / 1000)
    return best[3]


def parse_xids(text: str) -> list[tuple[PciKey, int, str]]:
    """``(PCI address, Xid, line)`` of each kernel-log line of an Xid
    (``NVRM: Xid (PCI:0000:9b:00): 119, pid=..., ...``)."""
    out = []
    for line in text.splitlines():
        m = _XID.search(line)
        key = pci_key(m.group(1)) if m else None
        if m and key:
            out.append((key, int(m.group(2)), line.strip()))
    return out


@dataclass(frozen=True)
class Finding:
    """One thing wrong with one GPU (``gpu`` is its index, or None when only its PCI
    address is known: ``where`` says it)."""

    gpu: Optional[int]
    status: Status
    text: str
    where: str = ""


class _Health:
    """What one host's agent gathered for the health rows, parsed once."""

    def __init__(self, plan: HostPlan, values: Mapping[str, str]) -> None:
        self.plan, self.v = plan, values
        self.rows, self.other = parse_health_csv(values.get("gpu_health_csv", ""))
        self.by_pci = {r.pci: r.index for r in self.rows if r.pci is not None}
        self.q = parse_q(values.get("gpu_q", ""))
        wanted = plan.worker.local_devices
        listed = [r.index for r in self.rows]
        self.used = listed if wanted == "all" else [i for i in listed
                                                    if isinstance(wanted, tuple) and i in wanted]

    def index_of(self, key: PciKey) -> Optional[int]:
        return self.by_pci.get(key)


def _is_error(value: str) -> bool:
    return any(mark in value for mark in ERROR_MARKS)


def _unreadable_fields(h: _Health) -> dict[int, list[tuple[str, str]]]:
    """``(field, value)`` of each ERR! or Unknown Error per GPU index: in the CSV, the
    table, and the health sections of ``-q``."""
    fields: dict[int, list[tuple[str, str]]] = {}
    for r in h.rows:
        for name, value in r.cells.items():
            if _is_error(value):
                fields.setdefault(r.index, []).append((name, value))
    for index, labels in parse_table_errors(h.v.get("gpu_table", "")).items():
        fields.setdefault(index, []).extend((lb, "ERR!") for lb in labels)
    for key, leaves in h.q.items():
        where = h.index_of(key)
        bad = [("/".join(p), v) for p, v in leaves.items() if p[0] in _Q_SECTIONS
               and _is_error(v)]
        if where is not None and bad:
            fields.setdefault(where, []).extend(bad)
    return fields


def _unreadable(h: _Health) -> list[Finding]:
    """A FAIL per GPU with a field the driver could not read from it (whatever nvidia-smi's
    exit status), and per line where nvidia-smi said it could not reach a GPU."""
    found = []
    for index, named in _unreadable_fields(h).items():
        names = list(dict.fromkeys(n for n, _ in named))
        marks = ", ".join(dict.fromkeys(v for _, v in named))
        found.append(Finding(index, Status.FAIL, f"unreadable ({marks}): {_listed(names, 16)} "
                             "(the driver cannot read the GPU: reset it or reboot the host)"))
    for line in h.other:
        if _is_error(line):
            pci = pci_key(line)
            label = f"GPU at PCI {_pci_words(pci)}" if pci else "a GPU"
            found.append(Finding(None, Status.FAIL, f"nvidia-smi: {_quote(line)}", label))
    return found


def _listed(items: list[str], most: int = 6) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _positive(value: str) -> bool:
    return value.isdigit() and int(value) > 0


def _ecc(path: tuple[str, ...], value: str) -> bool:
    """An uncorrectable ECC count above zero: ``ECC Errors/Volatile|Aggregate/...
    Uncorrectable...`` (Ampere and later: SRAM and DRAM), or the ``Total`` under ``Double
    Bit`` of the older layout."""
    if len(path) < 3 or path[0] != "ECC Errors" or path[1] not in ("Volatile", "Aggregate"):
        return False
    counted = "Uncorrectable" in path[-1] or ("Double Bit" in path and path[-1] == "Total")
    return counted and _positive(value)


def _counters(h: _Health) -> list[Finding]:
    """The ``-q`` counters of each used GPU: uncorrectable ECC errors, a retired page or a
    row remap pending, a failed remap (FAIL); clocks throttled by power or heat (warn)."""
    found: list[Finding] = []
    for key, leaves in h.q.items():
        index = h.index_of(key)
        if index is None or index not in h.used:
            continue
        for label, status, test, why in _COUNTER_RULES:
            hits = [f"{'/'.join(p)} = {v}" for p, v in leaves.items() if test(p, v)]
            if hits:
                found.append(Finding(index, status, f"{label}: {_listed(hits)} ({why})"))
    return found


_CounterTest = Callable[[tuple[str, ...], str], bool]
#: Each counter row: its words, its verdict, the leaves it reads, what it means.
_COUNTER_RULES: tuple[tuple[str, Status, _CounterTest, str], ...] = (
    ("uncorrectable ECC errors", Status.FAIL, _ecc,
     "its memory returned data it could not correct: drain and reset it, replace it if "
     "they come back"),
    ("retired page pending", Status.FAIL,
     lambda p, v: p[0] == "Retired Pages" and p[-1].startswith("Pending") and v == "Yes",
     "the page is retired at the next GPU reset: reset the GPU"),
    ("row remapping pending", Status.FAIL,
     lambda p, v: p == ("Remapped Rows", "Pending") and v == "Yes",
     "the remap takes effect at the next GPU reset: reset the GPU"),
    ("row remapping failed", Status.FAIL,
     lambda p, v: p == ("Remapped Rows", "Remapping Failure Occurred") and v == "Yes",
     "no spare row was left: the GPU needs replacing"),
    ("clocks throttled", Status.WARN,
     lambda p, v: p[0] in _CLOCK_SECTIONS and p[-1] in _THROTTLES and v == "Active",
     "power, heat or the board slows it: ranks on it run slower"),
)


def _xids(h: _Health) -> list[Finding]:
    """A warning per GPU the kernel log reports Xid errors for (since boot: may be old)."""
    seen: dict[PciKey, list[tuple[int, str]]] = {}
    for key, xid, line in parse_xids(h.v.get("gpu_xid", "")):
        seen.setdefault(key, []).append((xid, line))
    found = []
    for key, events in seen.items():
        index = h.index_of(key)
        if index is not None and index not in h.used:
            continue
        codes = ", ".join(str(x) for x in sorted({x for x, _ in events}))
        text = (f"kernel log reports Xid {codes} ({len(events)} since boot), last: "
                f"{_quote(events[-1][1])}")
        found.append(Finding(index, Status.WARN, text, f"GPU at PCI {_pci_words(key)}"))
    return found


def _foreign_processes(h: _Health) -> list[Finding]:
    """A launch's warning about processes holding memory on a used GPU (nothing of this run
    runs yet): prebuild-check's ``gpus`` row says it there, with the same words."""
    if not h.plan.fast:
        return []
    uuid_to_index = {r.uuid: r.index for r in h.rows}
    busy = _busy_gpus(h.v.get("gpu_apps", ""), uuid_to_index, h.used)
    return [Finding(i, Status.WARN, f"memory held by processes not of this run: pid "
                    f"{', '.join(p)}") for i, p in sorted(busy.items())]


def _matmul(h: _Health) -> tuple[list[Finding], str]:
    """The matmul's rows (FAIL on a mismatch or an error; a warning when it did not finish
    in time, which a slow import of torch explains as well as a hung GPU), and its note
    when it did not run (no torch, no CUDA, no interpreter): never a FAIL then."""
    got = h.v.get("gpu_matmul")
    if got is None:
        return [], ""
    if got.startswith("skip:"):
        return [], f"matmul not run: {_quote(got[5:])}"
    if got.startswith("timeout:"):
        gpus = ", ".join(str(i) for i in h.used)
        return [Finding(None, Status.WARN, f"matmul not checked: {_quote(got[8:])}",
                        f"GPU {gpus}")], ""
    if got.startswith("error:"):
        return [Finding(i, Status.FAIL, f"matmul program failed: {_quote(got[6:])}")
                for i in h.used], ""
    try:
        data = json.loads(got)
    except ValueError:
        data = {"skip": f"unreadable answer {got[:60]!r}"}
    if "skip" in data:
        return [], f"matmul not run: {_quote(str(data['skip']))}"
    found = []
    for index, result in sorted((data.get("results") or {}).items()):
        gpu = int(index) if str(index).isdigit() else None
        if "error" in result:
            found.append(Finding(gpu, Status.FAIL, f"matmul failed: {_quote(result['error'])}"))
        elif not result.get("ok"):
            found.append(Finding(gpu, Status.FAIL, "matmul differs from the CPU's: max "
                                 f"difference {result.get('max_diff')} (tolerance 1e-3)"))
    return found, "matmul matches the CPU"


def _no_counters(h: _Health) -> list[Finding]:
    """A warning per used GPU ``-q`` said nothing of: its counters were not checked."""
    if h.v.get("gpu_q_rc", "0") != "0":
        why = _quote((h.v.get("gpu_q", "").strip().splitlines() or ["no output"])[0])
        return [Finding(None, Status.WARN, f"nvidia-smi -q failed (status "
                        f"{h.v.get('gpu_q_rc')}): {why}: counters not checked", "GPU health")]
    read = {h.index_of(k) for k in h.q}
    return [Finding(i, Status.WARN, "nvidia-smi -q has no section for it: ECC, retired pages "
                    "and clocks not checked") for i in h.used if i not in read]


def _nvidia_smi_absent(plan: HostPlan, v: Mapping[str, str]) -> Optional[list[Check]]:
    """The rows when nvidia-smi is absent, or failed in prebuild-check: none there (its
    ``gpus`` row says so); in a launch a warning for an absent one (nothing to judge, and
    launches ran without this check before). None otherwise: a failing nvidia-smi is the
    health rows' FAIL in a launch (the ranks' CUDA would fail too)."""
    rc = v.get("gpu_health_rc", "")
    if rc == "missing":
        return [] if not plan.fast else [Check(
            plan.host, _HEALTH, Status.WARN,
            "local_devices is set but nvidia-smi is not on this host's PATH: GPU health not "
            "checked")]
    if not plan.fast and v.get("gpu_rc", "0") != "0":
        return []
    return None


def health_rows(plan: HostPlan, facts: HostFacts, ctl: object) -> list[Check]:
    """The GPU health rows (only with ``local_devices``), from what `fdl_fabric.agent.gpus.
    gather` found: one row per GPU and kind of fault, naming the field (FAIL or warn),
    then one ``ok`` row naming the healthy GPUs and what was checked, with a note for
    what could not be (no kernel log, no torch or CUDA for the matmul)."""
    v = facts.values
    if plan.worker.local_devices is None or "gpu_health_rc" not in v:
        return []
    early = _nvidia_smi_absent(plan, v)
    if early is not None:
        return early
    h = _Health(plan, v)
    if v["gpu_health_rc"] != "0" and not h.rows:
        first = _quote((v.get("gpu_health_csv", "").strip().splitlines() or ["no output"])[0])
        return [Check(plan.host, _HEALTH, Status.FAIL,
                      f"nvidia-smi failed (status {v['gpu_health_rc']}): {first}")]
    matmul_found, matmul_note = _matmul(h)
    found = (_unreadable(h) + _counters(h) + _no_counters(h) + matmul_found + _xids(h)
             + _foreign_processes(h))
    rows = [Check(plan.host, _HEALTH, f.status,
                  f"{f.where if f.gpu is None else f'GPU {f.gpu}'}: {f.text}")
            for f in sorted(found, key=lambda f: f.status is not Status.FAIL)]
    ok = _healthy_row(plan, h, found, matmul_note)
    return rows + ([ok] if ok else [])


def _healthy_row(plan: HostPlan, h: _Health, found: list[Finding],
                 matmul_note: str) -> Optional[Check]:
    """``GPU 0, 1 healthy: ...`` for the used GPUs nothing was found on, with what was
    checked; notes of what was not. None when there is nothing to say."""
    flagged = {f.gpu for f in found}
    healthy = [i for i in h.used if i not in flagged and i in {h.index_of(k) for k in h.q}]
    checked = ["no uncorrectable ECC error", "no retired page or row remap pending",
               "every field readable", "not throttled"]
    notes = []
    if "gpu_xid_error" in h.v:
        notes.append(f"kernel log not readable ({_quote(h.v['gpu_xid_error'])}): Xid not "
                     "checked")
    elif "gpu_xid" in h.v:
        checked.append("no Xid in the kernel log")
    if matmul_note == "matmul matches the CPU":
        checked.append(matmul_note)
    elif matmul_note:
        notes.append(matmul_note)
    parts = []
    if healthy:
        parts.append(f"GPU {', '.join(str(i) for i in healthy)} healthy: " + ", ".join(checked))
    parts.extend(notes)
    return Check(plan.host, _HEALTH, Status.OK, "; ".join(parts)) if parts else None

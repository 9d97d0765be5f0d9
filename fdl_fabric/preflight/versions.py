"""Whether every host runs the same Python, the same libraries and the same NCCL.

Each host's agent reports what its ranks' interpreter sees (`fdl_fabric.agent.versions`);
this compares the reports and says, one row per thing that differs, which host differs
and how: ``torch 2.12.1 on gpu-c, 2.13.0 on 3 others``. The odd host out is the one to
fix, so the value most hosts share is the reference and the others are named; when no
value has a majority (2 hosts against 2) each is named with its hosts.

A mismatch is a warning unless ``strict_versions: true`` makes it a FAIL: a patch-level
difference is often harmless, and only the user knows. A host whose versions could not
be read (its ``python:`` is missing, broken or too slow) is its own row, with the same
severity, since its versions are unknown rather than known to agree.

Pure: facts in, `Check` rows out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ..clusterfile.model import VersionsSpec
from .report import CONTROLLER, Check, Status

#: The ``check`` column of every row of this comparison.
CHECK = "versions"
#: Hosts named in one row at most; the rest are counted (``and 12 more``).
NAMED_MAX = 5
#: The longest version quoted from a host.
_VALUE_MAX = 120
#: The longest error quoted from a host (it names paths).
_ERROR_MAX = 500

#: A value reported as absent (a package not installed).
_ABSENT = None


def judge(facts: Mapping[str, Mapping[str, Any]], spec: VersionsSpec) -> list[Check]:
    """The rows of the version comparison, ``facts`` being host -> what its agent
    reported (`agent.versions.gather`), in roster order.

    Rows, in order: a host whose versions are unknown (one row each), then Python, each
    package, NCCL where they differ; or, when all that answered agree, one OK row
    naming the versions, on the controller's line (the comparison is its own).
    """
    bad = Status.FAIL if spec.strict else Status.WARN
    rows: list[Check] = []
    answered: dict[str, Mapping[str, Any]] = {}
    for host, f in facts.items():
        error = _failure(f)
        if error is None:
            answered[host] = f
        else:
            rows.append(Check(host, CHECK, bad, f"versions unknown: {error}"))
    if not answered:
        return rows
    agreed: list[str] = []
    differ = 0
    for label, values in _things(answered, spec):
        groups = _groups(values)
        if len(groups) == 1:
            value = next(iter(groups))
            agreed.append(f"{label} {value}" if value is not _ABSENT else
                          f"{label} not installed")
            continue
        host, reason = _differs(label, groups)
        rows.append(Check(host, CHECK, bad, reason))
        differ += 1
    if not differ:
        where = f"on all {len(answered)} hosts" if len(answered) > 1 else "on its one host"
        if len(answered) < len(facts):
            where = f"on the {len(answered)} host{_s(len(answered))} that answered"
        rows.append(Check(CONTROLLER, CHECK, Status.OK, f"{', '.join(agreed)} {where}"))
    return rows


def _failure(f: Mapping[str, Any]) -> Optional[str]:
    """Why a host's report tells nothing (its own error, or a malformed report)."""
    if not isinstance(f, Mapping):
        return "the agent sent no versions"
    if f.get("error"):
        return _text(f["error"], _ERROR_MAX)
    if not isinstance(f.get("packages"), Mapping) or not f.get("python"):
        return "the agent's report lacks the Python version or the packages"
    return None


def _things(answered: Mapping[str, Mapping[str, Any]], spec: VersionsSpec
            ) -> list[tuple[str, dict[str, Optional[str]]]]:
    """What is compared, each with its value per host: Python, the packages (those the
    file lists; else those reported, torch when installed), and NCCL on the hosts that
    have one (a host without a GPU has none and runs no NCCL, so it is not compared)."""
    things: list[tuple[str, dict[str, Optional[str]]]] = [
        ("python", {h: _text(f["python"]) for h, f in answered.items()})]
    names: list[str] = list(spec.packages) if spec.packages is not None else []
    if spec.packages is None:
        for f in answered.values():
            names += [str(n) for n in f["packages"] if str(n) not in names]
    for name in names:
        things.append((name, {h: _version(f["packages"].get(name))
                              for h, f in answered.items()}))
    nccl = {h: _text(f["nccl"]) for h, f in answered.items() if f.get("nccl")}
    if nccl:
        things.append(("NCCL", dict(nccl)))
    return things


def _version(value: Any) -> Optional[str]:
    return _ABSENT if value is None else _text(value)


def _groups(values: Mapping[str, Optional[str]]) -> dict[Optional[str], list[str]]:
    """Hosts by value, largest group first (ties: the value seen first)."""
    groups: dict[Optional[str], list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def _differs(label: str, groups: Mapping[Optional[str], list[str]]) -> tuple[str, str]:
    """The host to show in the row (the first one named) and the row's words: the
    minority values with their hosts, then the majority with its count; with no majority,
    every value with its hosts. At most `NAMED_MAX` hosts are named."""
    ordered = list(groups.items())
    top = len(ordered[0][1])
    majority = ordered[0] if len(ordered) < 2 or len(ordered[1][1]) < top else None
    named = ordered[1:] if majority is not None else ordered  # a tie: every value
    parts: list[str] = []
    budget = NAMED_MAX
    left_hosts = 0
    left_values = 0
    for value, hosts in named:
        if budget <= 0:
            left_hosts += len(hosts)
            left_values += 1
            continue
        shown = hosts[:budget]
        budget -= len(shown)
        who = _names(shown) if len(shown) == len(hosts) else \
            f"{', '.join(shown)} and {len(hosts) - len(shown)} more"
        parts.append(f"{_value(value)} on {who}")
    if left_values:
        parts.append(f"{left_values} other value{_s(left_values)} on {left_hosts} more "
                     f"host{_s(left_hosts)}")
    if majority is not None:
        count = len(majority[1])
        parts.append(f"{_value(majority[0])} on {count} other{_s(count)}")
    first_host = named[0][1][0]
    return first_host, f"{label} {', '.join(parts)}"


def _value(value: Optional[str]) -> str:
    return "not installed" if value is _ABSENT else str(value)


def _names(hosts: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(hosts) < 2:
        return "".join(hosts)
    return f"{', '.join(hosts[:-1])} and {hosts[-1]}"


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _text(value: Any, limit: int = _VALUE_MAX) -> str:
    """A value from a host on one line, bounded (the renderer makes it inert)."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit] + "…"

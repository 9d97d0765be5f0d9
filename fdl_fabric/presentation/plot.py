"""``plot-run``: a timeline picture of a run from its events.jsonl.

One row per rank, time since the launch across, one bar per attempt of each rank
coloured by how that attempt of the rank ended: completed, failed (the failure that
ended the attempt), tolerated (a death the elastic rules absorbed), stopped by the
launcher (the kill-all after someone else's failure), lost (its host went away), or
still running when the log ends. Attempts are shaded bands with their number; a
dashed line marks where each attempt's cohort formed; a cross marks each death. The
title carries the verdict and its exit code.

Reading the log (`read_timeline`) is pure and tested on its own; drawing (`draw`) uses
matplotlib, a well-kept library that writes both SVG and PNG, imported only here
because only this command needs it (the ``plot`` extra).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from ..events import Kind, Name
from .records import upgrade

#: How an attempt of a rank ended, in legend order, with its colour and hatch (the
#: hatch keeps the outcomes apart in grey print and for colour-blind readers).
OUTCOMES: dict[str, tuple[str, str, str]] = {
    "ok": ("completed", "#43a047", ""),
    "failed": ("failed", "#d32f2f", "xx"),
    "tolerated": ("tolerated death", "#8e24aa", "//"),
    "stopped": ("stopped by the launcher", "#fb8c00", ".."),
    "lost": ("lost (host gone)", "#616161", "\\\\"),
    "running": ("running at the end of the log", "#90caf9", ""),
}
#: The formats `draw` writes, by file suffix.
FORMATS = (".svg", ".png")
#: Beyond this many rank rows the labels are thinned out (a 1,000-rank run stays legible).
LABELLED_ROWS_MAX = 64


@dataclass
class Segment:
    """One attempt of one rank: when it started, when and how it ended."""

    attempt: int
    rank: int
    host: str
    start: float
    end: Optional[float] = None
    outcome: str = "running"
    #: Where to draw a death cross (failed, tolerated, lost, declared dead).
    death: Optional[float] = None


@dataclass
class Attempt:
    number: int
    start: float
    formed: Optional[float] = None
    end: Optional[float] = None


@dataclass
class Timeline:
    """What a run's events.jsonl says, in seconds since its first record."""

    run_id: str = ""
    span: float = 0.0
    segments: list[Segment] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    verdict: str = ""
    exit_code: Optional[int] = None

    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.segments})


def load_records(run_dir: Path) -> Iterable[dict[str, Any]]:
    """The records of ``<run_dir>/events.jsonl``, one at a time (a long run's log is
    never held whole)."""
    with (run_dir / "events.jsonl").open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    raw = json.loads(line)
                except ValueError:
                    raise ValueError(f"events.jsonl line {number} is not JSON") from None
                yield upgrade(raw) if isinstance(raw, dict) else raw


def _exit_outcome(record: dict[str, Any]) -> str:
    """How a rank's exit record ended it: lost when its host went away, else by kind."""
    data = _data(record)
    exit_ = data.get("exit") or {}
    if isinstance(exit_, dict) and exit_.get("lost"):
        return "lost"
    name, kind = record.get("name"), record.get("kind")
    if kind == Kind.TOLERATED.value:
        return "tolerated"
    if kind == Kind.DEATH.value:
        return "failed"
    if data.get("stopped") or name == Name.RANK_FORWARD_STOPPED.value:
        return "stopped"
    return "ok" if data.get("ok") else "failed"


#: The kinds of record that end a rank's attempt.
_ENDS = (Kind.EXIT.value, Kind.DEATH.value, Kind.TOLERATED.value)


def _data(record: dict[str, Any]) -> dict[str, Any]:
    data = record.get("data")
    return data if isinstance(data, dict) else {}


class _Reader:
    """Folds records into a `Timeline`; one record at a time."""

    def __init__(self) -> None:
        self.t0: Optional[float] = None
        self.last = 0.0
        self.line = Timeline()
        self.open: dict[int, Segment] = {}
        self.attempt: Optional[Attempt] = None
        #: Records about the run or a host, by name: each says whether it took the record
        #: (a host's record about one rank is read as that rank's).
        self._run_level: dict[str, Callable[[dict[str, Any], float], bool]] = {
            Name.LAUNCH.value: self._launch, Name.COHORT_FORMED.value: self._formed,
            Name.VERDICT.value: self._verdict, Name.HOST_LOST.value: self._host_gone,
            Name.HOST_UNRESPONSIVE.value: self._host_gone}
        #: Records about one rank, by name (the others end it when their kind says so).
        self._rank_level: dict[str, Callable[[int, dict[str, Any], float], None]] = {
            Name.RANK_STARTED.value: self._started,
            Name.RANK_DECLARED_DEAD.value: self._declared_dead}

    def feed(self, record: dict[str, Any]) -> None:
        t = float(record["time"])
        if self.t0 is None:
            self.t0 = t
        t -= self.t0
        self.last = max(self.last, t)
        self._attempt(int(record.get("attempt", 0) or 0), t)
        name, rank = record.get("name"), record.get("rank")
        run_level = self._run_level.get(str(name))
        if run_level is not None and run_level(record, t):
            return
        if rank is None:
            return
        rank_level = self._rank_level.get(str(name))
        if rank_level is not None:
            rank_level(rank, record, t)
        elif record.get("kind") in _ENDS and rank in self.open:
            self._close(self.open[rank], t, _exit_outcome(record))

    def _launch(self, record: dict[str, Any], _t: float) -> bool:
        self.line.run_id = str(_data(record).get("run_id", ""))
        return True

    def _formed(self, _record: dict[str, Any], t: float) -> bool:
        if self.attempt is not None:
            self.attempt.formed = t
        return True

    def _verdict(self, record: dict[str, Any], _t: float) -> bool:
        self.line.verdict = str(_data(record).get("verdict", ""))
        self.line.exit_code = _data(record).get("exit_code")
        return True

    def _host_gone(self, record: dict[str, Any], t: float) -> bool:
        if record.get("rank") is not None:
            return False
        host = record.get("host")
        for seg in list(self.open.values()):
            if seg.host == host:
                self._close(seg, t, "lost")
        return True

    def _started(self, rank: int, record: dict[str, Any], t: float) -> None:
        self.open[rank] = Segment(self.attempt.number if self.attempt else 0, rank,
                                  str(record.get("host") or ""), t)
        self.line.segments.append(self.open[rank])

    def _declared_dead(self, rank: int, _record: dict[str, Any], t: float) -> None:
        if rank in self.open:
            self.open[rank].death = t

    def _attempt(self, number: int, t: float) -> None:
        if self.attempt is not None and number <= self.attempt.number:
            return
        if self.attempt is not None:
            self.attempt.end = t
            self.open.clear()
        self.attempt = Attempt(number, t)
        self.line.attempts.append(self.attempt)

    def _close(self, seg: Segment, t: float, outcome: str) -> None:
        seg.end, seg.outcome = t, outcome
        if outcome in ("failed", "tolerated", "lost"):
            seg.death = t
        self.open.pop(seg.rank, None)

    def result(self) -> Timeline:
        if self.t0 is None:
            raise ValueError("no events to plot")
        self.line.span = max(self.last, 1e-3)
        if self.attempt is not None:
            self.attempt.end = self.line.span
        return self.line


def read_timeline(records: Iterable[dict[str, Any]]) -> Timeline:
    """The timeline of a run from its events.jsonl records, in order."""
    reader = _Reader()
    for record in records:
        reader.feed(upgrade(record))  # a log written before version 1 reads the same
    return reader.result()


def draw(line: Timeline, out: Path) -> Path:
    """Write the picture to ``out`` (SVG or PNG, by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text: searchable, selectable
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ranks = line.ranks()
    fig, ax = plt.subplots(figsize=(11, 2.4 + 0.28 * min(len(ranks), 120)))
    _draw_attempts(ax, line)
    _draw_segments(ax, line, {rank: i for i, rank in enumerate(ranks)})
    _rank_axis(ax, line, ranks)
    ax.set_xlim(0, line.span * 1.01)
    ax.set_xlabel("seconds since the launch")
    verdict = (f"{line.verdict} (exit {line.exit_code})" if line.verdict
               else "no verdict in the log (still running, or the launcher died)")
    ax.set_title(f"run {line.run_id or '?'}: {verdict}", loc="left", fontsize=11, pad=16)
    used = {seg.outcome for seg in line.segments}
    handles: list[Any] = [Patch(facecolor=c, hatch=h, edgecolor="white", label=label)
                          for key, (label, c, h) in OUTCOMES.items() if key in used]
    handles += [Line2D([], [], color="#1e88e5", linestyle="--", label="cohort formed"),
                Line2D([], [], color="black", marker="x", linestyle="", label="death"),
                Patch(facecolor="#eceff1", edgecolor="#b0bec5", label="attempt (shaded bands)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    fig.tight_layout()
    # 0600 like every file of a run folder: the picture names hosts and the run's outcome.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fig.savefig(fh, format=out.suffix[1:].lower(), dpi=110)
    plt.close(fig)
    return out


def _draw_attempts(ax: Any, line: Timeline) -> None:
    """Each attempt as a shaded band with its number, a dashed line where it formed."""
    for n, attempt in enumerate(line.attempts):
        end = attempt.end if attempt.end is not None else line.span
        ax.axvspan(attempt.start, end, color="#eceff1" if n % 2 else "#ffffff", zorder=0)
        ax.text(attempt.start, 1.01, f" attempt {attempt.number}", fontsize=9, va="bottom",
                transform=ax.get_xaxis_transform())
        if attempt.formed is not None:
            ax.axvline(attempt.formed, color="#1e88e5", linestyle="--", linewidth=1, zorder=3)


def _draw_segments(ax: Any, line: Timeline, row: dict[int, int]) -> None:
    """Each attempt of each rank as a bar coloured by its outcome, a cross at a death."""
    for seg in line.segments:
        _name, colour, hatch = OUTCOMES[seg.outcome]
        end = seg.end if seg.end is not None else line.span
        ax.broken_barh([(seg.start, max(end - seg.start, line.span / 500))],
                       (row[seg.rank] - 0.35, 0.7), facecolors=colour, hatch=hatch,
                       edgecolor="white", linewidth=0.5, zorder=2)
        if seg.death is not None:
            ax.plot([seg.death], [row[seg.rank]], marker="x", color="black", markersize=7,
                    markeredgewidth=2, zorder=4)


def _rank_axis(ax: Any, line: Timeline, ranks: list[int]) -> None:
    hosts: dict[int, list[str]] = {}
    for seg in line.segments:
        names = hosts.setdefault(seg.rank, [])
        if seg.host not in names:
            names.append(seg.host)
    step = max(1, -(-len(ranks) // LABELLED_ROWS_MAX))
    shown = list(range(0, len(ranks), step))
    ax.set_yticks(shown)
    ax.set_yticklabels([f"r{ranks[i]} {'/'.join(hosts[ranks[i]])}" for i in shown], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_ylabel("rank and host")


def plot_run(run_dir: str, output: str = "") -> list[Path]:
    """Draw ``<run_dir>/events.jsonl``: to ``output`` (its suffix picks SVG or PNG), or
    by default to ``timeline.svg`` and ``timeline.png`` in the run folder."""
    folder = Path(run_dir)
    outs = [Path(output)] if output else [folder / f"timeline{s}" for s in FORMATS]
    for out in outs:
        if out.suffix.lower() not in FORMATS:
            raise ValueError(f"{out}: the picture's name must end in .svg or .png")
    line = read_timeline(load_records(folder))
    return [draw(line, out) for out in outs]

"""``inv plot-run``: a timeline picture of a run from its events.jsonl.

Ranks against time: a bar from spawn to exit per rank, colored by how it
ended, a line where the cohort formed, a cross where a rank died. Plain SVG
written with the standard library, so it needs no plotting package.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

_COLORS = {"ok": "#4caf50", "failed": "#e53935", "stopped": "#fb8c00", "tolerated": "#8e24aa",
           "lost": "#757575", "running": "#90caf9"}


def load_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timeline_svg(events: list[dict[str, Any]]) -> str:
    """The SVG text; one row per rank seen in the events."""
    if not events:
        raise ValueError("no events to plot")
    t0 = float(events[0]["time"])
    t_end = float(max(e["time"] for e in events))
    span = max(t_end - t0, 1e-3)
    ranks: dict[int, dict[str, Any]] = {}
    formed = None
    for e in events:
        rank = e.get("rank")
        kind = e["event"]
        if kind == "formed":
            formed = e["time"]
        if rank is None:
            continue
        row = ranks.setdefault(rank, {"host": e.get("host", ""), "start": e["time"],
                                      "end": None, "how": "running", "death": None})
        if kind == "exit":
            row["end"] = e["time"]
            msg = e.get("message", "")
            row["how"] = ("ok" if e.get("ok") else
                          "stopped" if "stopped by the launcher" in msg else "failed")
        elif kind in ("death", "tolerated"):
            row["end"] = e["time"]
            row["death"] = e["time"]
            row["how"] = "tolerated" if kind == "tolerated" else "failed"
    left, top, width, row_h = 150, 40, 700, 22
    height = top + row_h * len(ranks) + 50

    def x(t: float) -> float:
        return left + (t - t0) / span * width

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 30}" '
             f'height="{height}" font-family="monospace" font-size="12">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left}" y="20" font-size="14">run timeline ({span:.1f}s)</text>']
    for i, rank in enumerate(sorted(ranks)):
        row = ranks[rank]
        y = top + i * row_h
        end = row["end"] if row["end"] is not None else t_end
        parts.append(f'<text x="5" y="{y + 14}">r{rank} {escape(row["host"])}</text>')
        parts.append(f'<rect x="{x(row["start"]):.1f}" y="{y + 3}" '
                     f'width="{max(x(end) - x(row["start"]), 1):.1f}" height="{row_h - 8}" '
                     f'fill="{_COLORS[row["how"]]}"><title>{row["how"]}</title></rect>')
        if row["death"] is not None:
            cx, cy = x(row["death"]), y + row_h / 2
            parts.append(f'<path d="M{cx - 5},{cy - 5} L{cx + 5},{cy + 5} M{cx - 5},{cy + 5} '
                         f'L{cx + 5},{cy - 5}" stroke="black" stroke-width="2"/>')
    if formed is not None:
        fx = x(formed)
        parts.append(f'<line x1="{fx:.1f}" y1="{top - 5}" x2="{fx:.1f}" '
                     f'y2="{top + row_h * len(ranks)}" stroke="#1e88e5" stroke-dasharray="4"/>')
        parts.append(f'<text x="{fx + 3:.1f}" y="{top - 8}" fill="#1e88e5">cohort formed</text>')
    legend_y = top + row_h * len(ranks) + 30
    for j, (name, color) in enumerate(_COLORS.items()):
        lx = left + j * 110
        parts.append(f'<rect x="{lx}" y="{legend_y - 10}" width="12" height="12" '
                     f'fill="{color}"/><text x="{lx + 16}" y="{legend_y}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def plot_run(run_dir: str, output: str = "") -> Path:
    folder = Path(run_dir)
    out = Path(output) if output else folder / "timeline.svg"
    out.write_text(timeline_svg(load_events(folder)))
    return out

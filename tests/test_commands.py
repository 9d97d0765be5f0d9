"""Shell assembly: every value reaches the program byte for byte."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdl_fabric import commands

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
@given(value=payloads)
def test_export_script_delivers_a_value_exactly(value: str) -> None:
    script = commands.export_script({"FDL_TEST_VALUE": value})
    out = _bash(script + 'printf %s "$FDL_TEST_VALUE"')
    assert out.stdout.decode("utf-8") == value


@settings(max_examples=60, deadline=None)
@given(args=st.lists(payloads, min_size=1, max_size=4))
def test_quoted_words_reach_argv_exactly(args: list[str]) -> None:
    line = "printf '%s\\0' " + " ".join(commands.quote(a) for a in args)
    out = _bash(line)
    assert out.stdout.decode("utf-8").split("\0")[:-1] == args


def test_export_script_refuses_a_name_that_would_be_code() -> None:
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        commands.export_script({"A=1; rm -rf /; B": "x"})


def test_export_script_refuses_nul_in_a_value() -> None:
    with pytest.raises(ValueError, match="NUL"):
        commands.export_script({"A": "x\0y"})


def test_preamble_is_envelope_line_then_nul_terminated_exports() -> None:
    text = commands.stdin_preamble("abc123", {"K": "v\nw"})
    assert text == "abc123\nexport K='v\nw'\n\0"


def test_preamble_refuses_a_non_hex_envelope() -> None:
    with pytest.raises(ValueError, match="hex"):
        commands.stdin_preamble("not hex!", {})


def test_split_command_keeps_quoted_words_whole() -> None:
    assert commands.split_command("python3 -c 'print(1 + 1)' --name \"a b\"") == [
        "python3", "-c", "print(1 + 1)", "--name", "a b"]


def test_split_command_rejects_empty_and_unbalanced() -> None:
    with pytest.raises(ValueError, match="empty"):
        commands.split_command("   ")
    with pytest.raises(ValueError, match="cannot split"):
        commands.split_command("python3 'oops")


def test_wrapper_refuses_an_empty_command() -> None:
    with pytest.raises(ValueError, match="empty"):
        commands.rank_wrapper(cwd="/", argv=[], kill_grace=1, read_preamble=False)


@pytest.mark.parametrize("login_shell", ["sh", "bash"])
def test_remote_command_runs_the_wrapper_under_any_login_shell(login_shell: str) -> None:
    wrapper = commands.rank_wrapper(cwd="/", argv=["printf", "%s|", "it's", "$x"],
                                    kill_grace=1, read_preamble=True)
    proc = subprocess.Popen([login_shell, "-c", commands.remote_command(wrapper)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    # The stdin stays open, as the launcher keeps it: EOF would mean "stop".
    proc.stdin.write(commands.stdin_preamble("00ff", {"X": "1"}).encode())
    proc.stdin.flush()
    assert proc.wait(10) == 0
    assert proc.stdout.read() == b"it's|$x|"
    proc.stdin.close()

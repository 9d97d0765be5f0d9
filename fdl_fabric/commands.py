"""Shell assembly: the rank wrapper, env scripts and the remote command line.

Everything that reaches a shell is built here, so there is exactly one place
where quoting happens. Every interpolated value goes through `shlex.quote`
once; nothing else in the package concatenates shell text.

The wrapper is the same bash program for local and remote ranks. It:

* starts the rank in its own session and process group (``setsid``), so a
  signal to the group reaches the rank's children too;
* reads the launcher's stdin in its main loop: control lines (``KILL``,
  ``USR1``, ...) are applied to the rank's group, and EOF means the launcher
  or its SSH connection is gone, which stops the rank (TERM, then KILL after
  the kill grace). sshd sends no SIGHUP to a session without a pty, so stdin
  EOF is the only reliable signal that the launcher went away;
* stops the rank the same way on HUP, TERM or INT;
* prints one marker line with the rank's pid before the rank starts, so the
  launcher knows the process group without a second round trip;
* exits with the rank's status (a shell reports a signal death N as 128+N).

Remote sessions receive, as the first stdin lines, the envelope (it carries the
per-run salt) and a NUL-terminated export script with the rank's environment,
so neither the salt nor user env values ever appear in any process's argv.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence

from .config import ENV_NAME_RE

#: Marker the wrapper prints on stderr (one line, before the rank starts) so
#: the launcher learns the rank's pid, which is also its process group id.
PID_MARKER = "\x1efdl-fabric-rank-pid "

#: Exit status of the wrapper when the stdin preamble is missing or cut short.
EXIT_NO_PREAMBLE = 125
#: Exit status of the wrapper when the working directory cannot be entered.
EXIT_BAD_CWD = 126
#: Exit status of the wrapper when the program cannot be started (setsid missing).
EXIT_NO_SETSID = 127

#: Control lines the launcher may write on a wrapper's stdin.
CONTROL_SIGNALS = ("KILL", "TERM", "INT", "HUP", "USR1", "USR2")

#: How often the wrapper wakes up to check its rank, in seconds. It bounds the
#: wrapper's share of exit-detection latency.
WRAPPER_TICK = 0.1


#: Per-user folder, on every host, holding one record per running rank.
REGISTRY_DIR = "/tmp/fdl-fabric-$UID"

#: Records the rank in the run registry: its process group, its start time as
#: the kernel reports it (field 22 of /proc/<pid>/stat) and the run id, in a
#: file only the user can read. Cleanup signals a group only while the
#: recorded start time still matches, so a recycled pid is never touched.
REGISTER_SNIPPET = (
    "__fdl_rec=\n"
    f'__fdl_reg="{REGISTRY_DIR}"\n'
    'if [ -n "${FLODL_INTERNAL_RUN_ID:-}" ] &&'
    ' { [ -d "$__fdl_reg" ] || mkdir -m 700 "$__fdl_reg"; } &&'
    ' [ -O "$__fdl_reg" ] && [ ! -L "$__fdl_reg" ] &&'
    ' IFS= read -r __fdl_stat < "/proc/$__fdl_pid/stat"; then\n'
    "  __fdl_stat=${__fdl_stat##*) }\n"
    "  set -- $__fdl_stat\n"
    '  __fdl_rec="$__fdl_reg/$FLODL_INTERNAL_RUN_ID.r${RANK:-x}"\n'
    "  ( umask 077; printf 'pgid=%s start=%s run=%s cluster=%s host=%s rank=%s\\n'"
    ' "$__fdl_pid" "${20}" "$FLODL_INTERNAL_RUN_ID" "${FLODL_INTERNAL_CLUSTER_KEY:-}"'
    ' "${FLODL_HOST_NAME:-}" "${RANK:-}" > "$__fdl_rec" ) || __fdl_rec=\n'
    "fi\n"
)


def quote(value: str) -> str:
    """Quote one value for a POSIX shell; the only quoting primitive we use."""
    return shlex.quote(value)


def export_script(env: Mapping[str, str]) -> str:
    """An ``export K='v'`` script, one line per variable, in the given order.

    Names are checked again here (not only in config) because this string is
    evaluated by a shell: an unchecked name would be code.
    """
    lines = []
    for key, value in env.items():
        if not ENV_NAME_RE.fullmatch(key):
            raise ValueError(f"not a valid environment variable name: {key!r}")
        if "\0" in value:
            raise ValueError(f"environment value of {key} contains a NUL byte")
        lines.append(f"export {key}={quote(value)}\n")
    return "".join(lines)


def stdin_preamble(envelope_hex: str, env: Mapping[str, str]) -> str:
    """What the launcher writes first on a remote wrapper's stdin.

    Line one is the hex envelope; then the export script, terminated by NUL
    (env values cannot contain NUL, so the terminator is unambiguous).
    """
    if not envelope_hex or any(c not in "0123456789abcdef" for c in envelope_hex):
        raise ValueError("the envelope must be lowercase hex")
    return f"{envelope_hex}\n{export_script(env)}\0"


def rank_wrapper(
    *,
    cwd: str,
    argv: Sequence[str],
    kill_grace: float,
    read_preamble: bool,
    envelope_var: str = "FLODL_INTERNAL_CLUSTER_JSON",
) -> str:
    """The bash program that runs one rank (see the module docstring).

    ``read_preamble`` is true for remote ranks, whose environment arrives on
    stdin; local ranks get theirs through the process environment.
    """
    if not argv:
        raise ValueError("the rank command is empty")
    ticks = max(1, math.ceil(kill_grace / WRAPPER_TICK))
    program = " ".join(quote(a) for a in argv)
    parts = []
    if read_preamble:
        parts.append(
            "IFS= read -r __fdl_envelope || { echo 'fdl-fabric: wrapper got no envelope on stdin'"
            f" >&2; exit {EXIT_NO_PREAMBLE}; }}\n"
            "IFS= read -r -d '' __fdl_env || { echo 'fdl-fabric: wrapper got no environment on"
            f" stdin' >&2; exit {EXIT_NO_PREAMBLE}; }}\n"
            'eval "$__fdl_env"; unset __fdl_env\n'
            f'export {envelope_var}="$__fdl_envelope"; unset __fdl_envelope\n'
        )
    parts.append(
        f"cd -- {cwd_word(cwd)} || exit {EXIT_BAD_CWD}\n"
        f"command -v setsid >/dev/null || {{ echo 'fdl-fabric: setsid not found' >&2;"
        f" exit {EXIT_NO_SETSID}; }}\n"
        "__fdl_pid=\n"
        "__fdl_left=-1\n"
        "__fdl_eof=0\n"
        "__fdl_buf=\n"
        # Signal the rank's process group. In the first instant after the
        # start the group may not exist yet (setsid has not run), so fall back
        # to the pid, which is then the subshell about to become the rank.
        # A trap can run between `&` and `__fdl_pid=$!`, hence `$!`.
        "__fdl_signal() {\n"
        '  set -- "$1" "${__fdl_pid:-$!}"\n'
        '  [ -n "$2" ] || return 1\n'
        '  kill "-$1" -- "-$2" 2>/dev/null || kill "-$1" "$2" 2>/dev/null\n'
        "}\n"
        "__fdl_stop() {\n"
        '  if [ "$__fdl_left" -lt 0 ]; then\n'
        f"    __fdl_signal TERM || exit 143\n"
        f"    __fdl_left={ticks}\n"
        "  fi\n"
        "}\n"
        "trap __fdl_stop HUP TERM INT\n"
        "trap '__fdl_signal USR1' USR1\n"
        "trap '__fdl_signal USR2' USR2\n"
        # The subshell prints its own pid, then becomes the rank: `exec` keeps
        # the pid, and setsid (not a group leader here) makes it the leader of
        # a new session and process group without forking.
        f"( printf '\\036{PID_MARKER[1:]}%s\\n' \"$BASHPID\" >&2;"
        f" exec setsid -- {program} </dev/null ) &\n"
        "__fdl_pid=$!\n"
        # From here on the wrapper itself is silent: bash would otherwise
        # print job notices ("Killed ...") into the rank's stderr.
        "exec 2>/dev/null\n"
        + REGISTER_SNIPPET
        +
        'while kill -0 "$__fdl_pid" 2>/dev/null; do\n'
        '  if [ "$__fdl_eof" = 0 ]; then\n'
        f"    if IFS= read -r -t {WRAPPER_TICK} __fdl_part; then\n"
        '      __fdl_line="$__fdl_buf$__fdl_part"; __fdl_buf=\n'
        '      case "$__fdl_line" in\n'
        "        TERM) __fdl_stop ;;\n"
        '        KILL|INT|HUP|USR1|USR2) __fdl_signal "$__fdl_line" ;;\n'
        "      esac\n"
        "    else\n"
        # Above 128 is a timeout, which may leave the first bytes of a line
        # that was arriving; keep them. Anything else is EOF.
        '      if [ "$?" -gt 128 ]; then __fdl_buf="$__fdl_buf$__fdl_part"; else\n'
        "        __fdl_eof=1\n"
        "        __fdl_stop\n"
        "      fi\n"
        "    fi\n"
        "  else\n"
        f"    sleep {WRAPPER_TICK}\n"
        "  fi\n"
        '  if [ "$__fdl_left" -gt 0 ]; then\n'
        "    __fdl_left=$((__fdl_left - 1))\n"
        '  elif [ "$__fdl_left" -eq 0 ]; then\n'
        "    __fdl_signal KILL\n"
        "    __fdl_left=-2\n"
        "  fi\n"
        "done\n"
        'wait "$__fdl_pid"\n'
        "__fdl_rc=$?\n"
        # Children that outlived the rank still hold its process group: they
        # are orphans of this run, so they get the same TERM/KILL.
        'if kill -0 -- "-$__fdl_pid" 2>/dev/null; then\n'
        '  kill -TERM -- "-$__fdl_pid" 2>/dev/null\n'
        f"  __fdl_left={ticks}\n"
        '  while [ "$__fdl_left" -gt 0 ] && kill -0 -- "-$__fdl_pid" 2>/dev/null; do\n'
        f"    sleep {WRAPPER_TICK}; __fdl_left=$((__fdl_left - 1))\n"
        "  done\n"
        '  kill -KILL -- "-$__fdl_pid" 2>/dev/null\n'
        "fi\n"
        '[ -n "$__fdl_rec" ] && rm -f -- "$__fdl_rec"\n'
        'exit "$__fdl_rc"\n'
    )
    return "".join(parts)


def cwd_word(path: str) -> str:
    """A working directory as one shell word; ``~`` and ``~/x`` mean the rank's home."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + quote(path[2:])
    return quote(path)


def remote_command(wrapper: str) -> str:
    """The command string for an SSH session: bash runs the wrapper.

    The wrapper is quoted once as a whole, so it works under any login shell
    (sh, zsh, fish) and its own quoting reaches bash untouched. ``--norc``:
    the login shell has already read the user's rc file and exported its
    environment; bash would read it a second time for a command run by sshd.
    """
    return f"exec bash --norc -c {quote(wrapper)}"


def split_command(command: str) -> list[str]:
    """Shell words of a ``command`` string from cluster.yml or ``--cmd``.

    The command is split into argv and each word re-quoted in the wrapper, so
    values reach the rank exactly; shell syntax (pipes, ``&&``) is not
    interpreted. Wrap the command in ``bash -c '...'`` to use it.
    """
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"cannot split command {command!r}: {exc}") from None
    if not words:
        raise ValueError("the command is empty")
    return words

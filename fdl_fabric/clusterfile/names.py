"""The grammar of names and values a cluster file hands to DNS, paramiko, shells and tables.

Each ``*_problem`` function returns None for an acceptable value, else the reason, worded
to follow the key in a ``file:line: key: message`` line. A host name or option value is
used verbatim later, so a space, ``;`` or newline in one is refused here, with its line,
instead of resurfacing as an unrelated failure (or a different ssh option). `sshopts`
applies the same rules to names built in code.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import unicodedata
from typing import Callable, Optional

from ..limits import (
    ARG_STRLEN_MAX,
    COMMAND_MAX_BYTES,
    HOST_LABEL_MAX,
    HOST_NAME_MAX,
    PATH_MAX_BYTES,
    PORT_MAX,
    SECONDS_MAX,
    SSH_OPTION_MAX_BYTES,
    USER_NAME_MAX,
)
from ..shell import shell_words

SHOWN_MAX = 60  # characters of a user's value quoted in a message
KEY_MAX = 200  # characters of a key path in a message
MESSAGE_MAX = 600  # characters of a message; a last resort, the parts are shortened first


def shown(value: str) -> str:
    """repr() of a user's value, shortened: messages must stay readable (and small) even for
    a value of a megabyte."""
    if len(value) <= SHOWN_MAX:
        return repr(value)
    return f"{value[:SHOWN_MAX]!r}... ({len(value)} characters)"


def clip(text: str, limit: int) -> str:
    """Shorten a finished message or key, and make it printable: a lone surrogate (from a
    ``"\\ud800"`` escape or a file name that is not UTF-8) would break printing it."""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if SURROGATE_RE.search(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text



#
# Each ``*make_problem`` function returns None for an acceptable value, else the reason, worded to
# follow "key: " in a Problem. ``ssh`` reuses the ssh ones, so a WorkerSpec built in code
# meets the same rules as one read from a file.

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: anything that can
# end or hide a line.
CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
SURROGATE_RE = re.compile("[\ud800-\udfff]")
_CHAR_NAMES = {" ": "a space", "\n": "a newline", "\r": "a carriage return", "\t": "a tab"}

_HOST_GRAMMAR = "letters, digits, '-', '_' and '.' (a DNS name), or an IPv4 or IPv6 address"
_HOST_BAD_CHAR_RE = re.compile(r"[^A-Za-z0-9._-]")
_DOTTED_NUMBERS_RE = re.compile(r"[0-9.]+")
_IPV6_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_PORT_RE = re.compile(r"[0-9]{1,5}")
_SECONDS_RE = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")
_COUNT_TEXT_RE = re.compile(r"[0-9]{1,9}")
_SSH_OPTION_RE = re.compile(r" *[A-Za-z][A-Za-z0-9]* *=.*")
_STRICT_VALUES = ("yes", "no", "accept-new", "off", "ask")


def _char(c: str) -> str:
    """Name a character the way a person would look for it in an editor."""
    if c in _CHAR_NAMES:
        return _CHAR_NAMES[c]
    if c.isprintable():
        return repr(c)
    return f"the character U+{ord(c):04X} ({unicodedata.name(c, 'a control character')})"


def single_line_problem(text: str) -> Optional[str]:
    """Refuse text with a line break or another control character (values handed to ssh)."""
    bad = CONTROL_RE.search(text)
    if bad:
        return f"contains {_char(bad.group())}; it must be a single line of printable text"
    return None


def host_name_problem(name: str) -> Optional[str]:
    """A DNS name (labels of letters, digits, '-' and '_' separated by dots, none starting or
    ending with '-', 253 characters at most) or an IPv4/IPv6 address.

    Anything else would reach DNS, ssh or a table verbatim. A label may not start with '-' so
    that no host can read as a command-line option, and names made of digits must be proper
    dotted quads because the resolver reads ``10.1`` or ``010.0.0.1`` as other addresses.
    """
    if ":" in name:
        return _ipv6_problem(name)
    if len(name) > HOST_NAME_MAX:
        return f"is {len(name)} characters long; a host name has at most {HOST_NAME_MAX}"
    bad = _HOST_BAD_CHAR_RE.search(name)
    if bad:
        return f"contains {_char(bad.group())}; a host name is {_HOST_GRAMMAR}"
    core = name[:-1] if name.endswith(".") else name  # a trailing dot: an absolute name
    for label in core.split("."):
        if not label:
            return f"{name!r} has an empty label (a leading '.' or '..')"
        if len(label) > HOST_LABEL_MAX:
            return f"has a label of {len(label)} characters; DNS allows {HOST_LABEL_MAX}"
        if label.startswith("-") or label.endswith("-"):
            return f"label {label!r} starts or ends with '-'; a host name is {_HOST_GRAMMAR}"
    if _DOTTED_NUMBERS_RE.fullmatch(core) or _inet_aton(core):
        try:
            ipaddress.IPv4Address(core)
        except ValueError:
            return (
                f"{name!r} is not a valid IPv4 address (write four numbers 0-255 without "
                "leading zeros, e.g. 10.0.0.1)"
            )
    return None


def _inet_aton(text: str) -> bool:
    """True when the C resolver would read ``text`` as an IPv4 address (``0x7f.1`` is one)."""
    try:
        socket.inet_aton(text)
    except OSError:
        return False
    return True


def _ipv6_problem(text: str) -> Optional[str]:
    if text.startswith("["):
        return f"{shown(text)}: write an IPv6 address without brackets"
    address, percent, scope = text.partition("%")
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return f"{shown(text)} is not a valid IPv6 address (a host name is {_HOST_GRAMMAR})"
    if percent and not _IPV6_SCOPE_RE.fullmatch(scope):
        return f"{shown(text)} has an invalid zone (after '%': an interface name or number)"
    return None


def user_name_problem(user: str) -> Optional[str]:
    """A login name: letters, digits, '_', '.', '-' (not first), 64 characters at most.

    Other names (``DOMAIN\\user``) can still be set as ``User`` in ~/.ssh/config.
    """
    if len(user) > USER_NAME_MAX:
        return f"is {len(user)} characters long; a user name has at most {USER_NAME_MAX}"
    if not _USER_RE.fullmatch(user):
        return (
            f"{shown(user)} is not a user name (letters, digits, '_', '.' and '-', "
            "not starting with '-' or '.')"
        )
    return None


def ssh_target_problem(target: str) -> Optional[str]:
    """``host`` or ``user@host``, as ssh takes it (the last '@' separates the user)."""
    user, at, host = target.rpartition("@")
    if at:
        problem = user_name_problem(user)
        if problem:
            return f"user part {problem}"
    return host_name_problem(host)


def _port_problem(text: str) -> Optional[str]:
    if _PORT_RE.fullmatch(text) and 1 <= int(text) <= PORT_MAX:
        return None
    return f"must be a port number between 1 and {PORT_MAX}"


def _seconds_problem(text: str) -> Optional[str]:
    if _SECONDS_RE.fullmatch(text) and float(text) <= SECONDS_MAX:
        return None
    return f"must be a number of seconds between 0 and {SECONDS_MAX}"


def _count_problem(text: str) -> Optional[str]:
    return None if _COUNT_TEXT_RE.fullmatch(text) else "must be a whole number >= 0"


def _strict_problem(text: str) -> Optional[str]:
    if text.lower() in _STRICT_VALUES:
        return None
    return "must be one of yes, no, accept-new"


def _yes_no_problem(text: str) -> Optional[str]:
    return None if text.lower() in ("yes", "no") else "must be yes or no"


def _file_option_problem(text: str) -> Optional[str]:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > PATH_MAX_BYTES:
        return f"is {size} bytes long; a path has at most {PATH_MAX_BYTES} (PATH_MAX)"
    return None


def _proxy_jump_problem(text: str) -> Optional[str]:
    """``none`` or comma-separated ``[user@]host[:port]`` hops, as ``ssh.make_connection``
    splits them (so an IPv6 jump host, which needs brackets, is not accepted)."""
    if text == "none":
        return None
    for hop in text.split(","):
        hop = hop.strip()
        if not hop:
            return "has an empty jump host (write [user@]host[:port], separated by commas)"
        user, at, host_port = hop.rpartition("@")
        host, colon, port = host_port.partition(":")
        if at:
            problem = user_name_problem(user)
            if problem:
                return f"jump host {shown(hop)}: user part {problem}"
        if ":" in port:
            return (
                f"jump host {shown(hop)}: IPv6 jump hosts are not supported; name it in "
                "~/.ssh/config"
            )
        problem = host_name_problem(host) or (_port_problem(port) if colon else None)
        if problem:
            return f"jump host {shown(hop)}: {problem}"
    return None


# Values the launcher interprets, by lowercase option name. Which names are supported at all
# is decided in ``ssh`` (an unknown one is refused there, still before anything starts).
_SSH_VALUE_RULES: dict[str, Callable[[str], Optional[str]]] = {
    "port": _port_problem,
    "hostname": host_name_problem,
    "user": user_name_problem,
    "proxyjump": _proxy_jump_problem,
    "connecttimeout": _seconds_problem,
    "serveraliveinterval": _seconds_problem,
    "serveralivecountmax": _count_problem,
    "stricthostkeychecking": _strict_problem,
    "forwardagent": _yes_no_problem,
    "identityfile": _file_option_problem,
    "userknownhostsfile": _file_option_problem,
}


def ssh_option_value_problem(key: str, value: str) -> Optional[str]:
    """Why ``key=value`` (both stripped) is not a usable value for that option, or None."""
    problem = single_line_problem(value)
    if problem is None and not value:
        problem = "has no value"
    if problem is None:
        rule = _SSH_VALUE_RULES.get(key.lower())
        problem = rule(value) if rule else None
    return None if problem is None else f"{key}={shown(value)}: {problem}"


def ssh_option_problem(option: str) -> Optional[str]:
    """An ``ssh.options`` entry: one line, ``Key=Value``, and a value its option can take."""
    size = len(option.encode("utf-8", "surrogatepass"))
    if size > SSH_OPTION_MAX_BYTES:
        return f"is {size} bytes long; an ssh option has at most {SSH_OPTION_MAX_BYTES}"
    problem = single_line_problem(option)
    if problem:
        return problem
    if not _SSH_OPTION_RE.fullmatch(option):
        return (
            "expected 'Key=Value' (an ssh -o option, e.g. 'StrictHostKeyChecking=accept-new'), "
            f"got {shown(option)}"
        )
    key, _, value = option.partition("=")
    return ssh_option_value_problem(key.strip(), value.strip())


def command_problem(command: str) -> Optional[str]:
    """The command must split into words (as the launcher will split it) that exec can take:
    no NUL, at most ``COMMAND_MAX_BYTES`` in all, and no word over MAX_ARG_STRLEN."""
    size = len(command.encode("utf-8", "surrogatepass"))
    if size > COMMAND_MAX_BYTES:
        return (
            f"is {size} bytes long; a command has at most {COMMAND_MAX_BYTES} "
            f"({COMMAND_MAX_BYTES >> 10} KiB)"
        )
    if "\0" in command:
        return "contains a NUL character, which no program argument can hold"
    try:
        words = shell_words(command)
    except ValueError as exc:  # e.g. an unbalanced quote: fail now, not on every host
        return f"cannot be split into shell words: {exc}"
    for number, word in enumerate(words, 1):
        word_size = len(word.encode("utf-8", "surrogatepass"))
        if word_size > ARG_STRLEN_MAX:
            return (
                f"word {number} is {word_size} bytes long; Linux limits one program argument "
                f"to {ARG_STRLEN_MAX} bytes (MAX_ARG_STRLEN)"
            )
    return None


def path_problem(path: str) -> Optional[str]:
    if "\0" in path:
        return "contains a NUL character, which no path can hold"
    if "\n" in path or "\r" in path:
        return "contains a line break; a path must be a single line"
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > PATH_MAX_BYTES:
        return f"is {size} bytes long; a path has at most {PATH_MAX_BYTES} (PATH_MAX)"
    return None


def ifname_problem(ifname: str) -> Optional[str]:
    """Exported as NCCL_SOCKET_IFNAME: one line, and it must fit in one env string."""
    size = len("NCCL_SOCKET_IFNAME=") + len(ifname.encode("utf-8", "surrogatepass"))
    if size > ARG_STRLEN_MAX:
        return f"is too long for an environment variable ({size} bytes; at most {ARG_STRLEN_MAX})"
    return single_line_problem(ifname)



def unicode_problem(text: str) -> Optional[str]:
    bad = SURROGATE_RE.search(text)
    if bad:
        return f"contains a lone surrogate U+{ord(bad.group()):04X}, which is not valid Unicode"
    return None



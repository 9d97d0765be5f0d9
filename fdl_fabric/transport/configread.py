"""paramiko's ssh_config reader, with ``Match exec`` left alone while nothing may run.

paramiko's `SSHConfig.lookup` runs the command of a ``Match exec`` criterion (through
invoke) as it decides whether the block applies: looking a host up runs a program.
Inside `configtrust.inert` (a dry run) such a criterion is not evaluated and its block
is not applied, whether written ``exec`` or ``!exec``: the dry run shows the settings
every other line gives. Everything else is paramiko's, unchanged. Imported only where a
host is reached over SSH (`sshconfig.read_config`), so a local-only launch loads no
paramiko.

**Parsed once, each host looked up once** (issue 35). paramiko parses a file in Python
and walks every block for each lookup: with an ssh_config of 1,024 ``Host`` blocks that
is about 24 ms a parse and 48 ms a lookup, and the launcher read and looked up the file
for every worker and every connection: a dry run of 1,024 workers naming one such file
took 49 s. `parsed` keeps each text's blocks (by the text itself: a file that changed is
parsed, and checked, again), and a config made from them remembers each host's answer,
unless the text has a ``Match exec``, whose answer may change from one call to the
next (and which runs nothing while commands may not run).
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Sequence
from typing import Any, Optional

import paramiko

from .configtrust import commands_may_run


class InertAwareConfig(paramiko.SSHConfig):
    """`paramiko.SSHConfig` whose ``Match exec`` runs only while commands may run, and
    which answers a host it was asked about before from its texts' memo (`parsed`)."""

    #: The answers by host, shared by every config of the same texts; None: not
    #: remembered (a ``Match exec``, or parsed by paramiko itself). Only a ``Match
    #: exec`` answers differently inside `configtrust.inert`, so the host is the key.
    _answers: Optional[dict[str, paramiko.SSHConfigDict]] = None

    def lookup(self, hostname: str) -> paramiko.SSHConfigDict:
        answers = self._answers
        if answers is None:
            return super().lookup(hostname)
        found = answers.get(hostname)
        if found is None:
            found = answers[hostname] = super().lookup(hostname)
        # The caller's own copy: Fabric and the launcher read it, and may add to it.
        return paramiko.SSHConfigDict(
            {k: list(v) if isinstance(v, list) else v for k, v in found.items()})

    def _does_match(self, match_list: list[dict[str, Any]], target_hostname: str,
                    canonical: bool, final: bool, options: Any) -> Any:
        if not match_list:  # a Host block: paramiko asks for the local user name first
            return []  # (a getpwuid a block a lookup), for a list it then finds empty
        if not commands_may_run() and any(m.get("type") == "exec" for m in match_list):
            return False  # unevaluated: the block does not apply, nothing runs
        return super()._does_match(  # type: ignore[misc]
            match_list, target_hostname, canonical, final, options)


class _Texts:
    """ssh_config texts, parsed: their blocks in order, and the memo of their answers."""

    def __init__(self, texts: Sequence[str]) -> None:
        config = paramiko.SSHConfig()
        for text in texts:
            config.parse(io.StringIO(text))
        self.blocks: list[dict[str, Any]] = list(getattr(config, "_config"))  # noqa: B009
        has_exec = any(m.get("type") == "exec" for block in self.blocks
                       for m in block.get("matches", ()))
        self.answers: Optional[dict[str, paramiko.SSHConfigDict]] = (
            None if has_exec else {})


#: Parsed texts by their digest, the last few (a launch reads one or two files).
_TEXTS: dict[bytes, _Texts] = {}
_TEXTS_KEPT = 8
_TEXTS_LOCK = threading.Lock()


def parsed(texts: Sequence[str]) -> InertAwareConfig:
    """A config of ``texts`` (in order, as if one file), each distinct set parsed once a
    process. Its blocks are shared, never changed: paramiko's lookup copies what it
    takes from them."""
    digest = hashlib.sha256("\0\0".join(texts).encode("utf-8", "surrogatepass")).digest()
    with _TEXTS_LOCK:
        kept = _TEXTS.get(digest)
        if kept is None:
            kept = _Texts(texts)
            if len(_TEXTS) >= _TEXTS_KEPT:
                _TEXTS.pop(next(iter(_TEXTS)))
            _TEXTS[digest] = kept
    config = InertAwareConfig()
    setattr(config, "_config", list(kept.blocks))  # noqa: B010
    config._answers = kept.answers
    return config


__all__ = ["InertAwareConfig", "parsed"]

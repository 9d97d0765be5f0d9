"""paramiko's ssh_config reader, with ``Match exec`` left alone while nothing may run.

paramiko's `SSHConfig.lookup` runs the command of a ``Match exec`` criterion (through
invoke) as it decides whether the block applies: looking a host up runs a program.
Inside `configtrust.inert` (a dry run) such a criterion is not evaluated and its block
is not applied, whether written ``exec`` or ``!exec``: the dry run shows the settings
every other line gives. Everything else is paramiko's, unchanged. Imported only where a
host is reached over SSH (`sshconfig.read_config`), so a local-only launch loads no
paramiko.
"""

from __future__ import annotations

from typing import Any

import paramiko

from .configtrust import commands_may_run


class InertAwareConfig(paramiko.SSHConfig):
    """`paramiko.SSHConfig` whose ``Match exec`` runs only while commands may run."""

    def _does_match(self, match_list: list[dict[str, Any]], target_hostname: str,
                    canonical: bool, final: bool, options: Any) -> Any:
        if not commands_may_run() and any(m.get("type") == "exec" for m in match_list):
            return False  # unevaluated: the block does not apply, nothing runs
        return super()._does_match(  # type: ignore[misc]
            match_list, target_hostname, canonical, final, options)


__all__ = ["InertAwareConfig"]

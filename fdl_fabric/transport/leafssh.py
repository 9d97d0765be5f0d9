"""The OpenSSH command line a gateway's relay runs to reach one of its leaves.

The relay on the gateway starts each leaf's agent with the host's own ``ssh`` (not
paramiko: it runs with the gateway's Python, standard library only), so the settings
the launcher resolved for the leaf travel as that command line: its target, port, user,
identity file and options, then ours (`sshconfig.DEFAULT_OPTIONS`, a fast key exchange,
no shared master connection).
"""

from __future__ import annotations

from typing import Optional

from ..clusterfile import WorkerSpec
from .sshconfig import DEFAULT_OPTIONS, SUPPORTED_OPTIONS, SshSettings

#: Key exchanges a leaf's ssh offers, curve25519 first: OpenSSH's default since 9.0
#: (sntrup761x25519) costs 100-120 ms of the gateway's CPU per leaf, curve25519 ~15 ms.
#: The others keep a leaf whose sshd lacks curve25519 reachable.
LEAF_KEX = ("curve25519-sha256,curve25519-sha256@libssh.org,ecdh-sha2-nistp256,"
            "ecdh-sha2-nistp384,ecdh-sha2-nistp521,diffie-hellman-group-exchange-sha256,"
            "diffie-hellman-group16-sha512,diffie-hellman-group18-sha512,"
            "diffie-hellman-group14-sha256")
#: Options every leaf's ssh gets after the user's (OpenSSH keeps the first value given):
#: no prompt, no tty, no X11, no shared master connection (each leaf's session is its
#: own, so closing its stdin is its leash), and no chatter on the agent's stderr.
LEAF_OPTIONS = ("ControlMaster=no", "ControlPath=none", "LogLevel=ERROR")


def _option_keys(options: tuple[str, ...]) -> set[str]:
    return {opt.partition("=")[0].strip().lower() for opt in options}


def _config_sets_kex(settings: Optional[SshSettings], host: str) -> bool:
    """Does the worker's ``ssh -F`` file set KexAlgorithms for it? (The gateway's own
    ~/.ssh/config cannot be read from here; the command line wins over it.)"""
    if settings is None or not settings.config_file:
        return False
    from .sshconfig import SshOptionError, read_config

    try:
        found = read_config(settings.config_file, checked=settings.config_checked).lookup(host)
    except (OSError, SshOptionError):
        return False
    return "kexalgorithms" in found


def leaf_ssh_argv(worker: WorkerSpec, settings: Optional[SshSettings]) -> list[str]:
    """The OpenSSH command line (without the remote command) a gateway runs to reach
    ``worker``: its explicit target, port, user and identity file, then the user's
    options as written (OpenSSH keeps the first value of an option, so they win), then
    ours: `sshconfig.DEFAULT_OPTIONS` (BatchMode=yes, accept-new, timeouts, keepalives),
    KexAlgorithms with curve25519 first unless the user's ``-F`` file sets it, and
    `LEAF_OPTIONS`. Paths (identity file, known_hosts) must exist on the gateway."""
    spec = worker.ssh
    argv = ["ssh", "-T", "-x"]
    if settings is not None and settings.config_file:
        argv += ["-F", settings.config_file]
    port = settings.port if settings is not None else spec.port
    user = settings.user if settings is not None else spec.user
    if port:
        argv += ["-p", str(port)]
    if user:
        argv += ["-l", user]
    if spec.identity_file:
        argv += ["-i", spec.identity_file]
    options = tuple(opt.strip() for opt in spec.options)
    for opt in options:
        argv += ["-o", opt]
    for key, value in DEFAULT_OPTIONS.items():  # after the user's: theirs win
        argv += ["-o", f"{SUPPORTED_OPTIONS[key]}={value}"]
    if "kexalgorithms" not in _option_keys(options) and \
            not _config_sets_kex(settings, worker.host):
        argv += ["-o", f"KexAlgorithms={LEAF_KEX}"]
    for opt in LEAF_OPTIONS:
        argv += ["-o", opt]
    target = settings.target if settings is not None else worker.ssh_target
    return [*argv, "--", target]


__all__ = ["LEAF_KEX", "LEAF_OPTIONS", "leaf_ssh_argv"]

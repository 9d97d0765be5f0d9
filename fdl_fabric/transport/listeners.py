"""What sshd listens on for a tunnel's port: whether ``GatewayPorts yes`` exposed it.

A remote forward asks sshd to listen on loopback, but sshd with ``GatewayPorts yes`` binds
every address whatever the launcher asked, so any machine that reaches the host could dial
the coordinator through it. Once a forward listens, `check_exposure` asks the host which
addresses listen on the port (the listening sockets of /proc/net/tcp and tcp6, over a
session of the tunnel's own SSH connection) and reports the ones beyond loopback
(`Name.TUNNEL_EXPOSED`). No answer is no warning: the tunnel works either way.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any, Callable, Optional, Union

from ..events import Name

log = logging.getLogger(__name__)

#: Seconds the check may take; it asks for the listening sockets only.
_EXPOSURE_TIMEOUT = 15.0
_LISTENERS = "awk '$4 == \"0A\" {print $2}' /proc/net/tcp /proc/net/tcp6 2>/dev/null"
#: Bytes read at a time, and at most, of the host's answer.
_CHUNK = 65536
_ANSWER_MAX = 1 << 20


def check_exposure(transport: Any, port: int,
                   report: Callable[[Name, dict[str, Any]], None]) -> None:
    """Warn when sshd listens on ``port`` beyond loopback (``GatewayPorts yes``);
    ``transport``: the tunnel's paramiko transport."""
    try:
        chan = transport.open_session(timeout=_EXPOSURE_TIMEOUT)
        try:
            chan.settimeout(_EXPOSURE_TIMEOUT)
            chan.exec_command(_LISTENERS)
            out = bytearray()
            while len(out) < _ANSWER_MAX:
                data = chan.recv(_CHUNK)
                if not data:
                    break
                out += data
        finally:
            chan.close()
    except Exception as exc:  # no answer is no warning; the tunnel works either way
        log.debug("tunnel %s: could not list the host's listeners: %s", port, exc)
        return
    exposed = exposed_listeners(out.decode("ascii", "replace"), port)
    if exposed:
        report(Name.TUNNEL_EXPOSED, {"port": port, "addresses": exposed})


def _proc_address(word: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    """An address as /proc/net/tcp{,6} writes it: hex, each 32-bit word in host order
    (little-endian on every machine this runs on)."""
    try:
        raw = bytes.fromhex(word)
    except ValueError:
        return None
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    if len(raw) == 16:
        return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return None


def exposed_listeners(text: str, port: int) -> list[str]:
    """Addresses other than loopback that listen on ``port``, from the ``local_address``
    words (``0100007F:7A69``) of /proc/net/tcp and tcp6's listening sockets."""
    found: list[str] = []
    for word in text.split():
        addr_hex, _, port_hex = word.partition(":")
        try:
            if int(port_hex, 16) != port:
                continue
        except ValueError:
            continue
        addr = _proc_address(addr_hex)
        if addr is None or addr.is_loopback:
            continue
        mapped = getattr(addr, "ipv4_mapped", None)
        if mapped is not None and mapped.is_loopback:
            continue
        if str(addr) not in found:
            found.append(str(addr))
    return found

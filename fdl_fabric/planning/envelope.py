"""Envelopes: what a rank learns about its run, and the map of prebuilt binaries.

The slim envelope (``FLODL_INTERNAL_CLUSTER_JSON``) is hex-encoded JSON, as in
flodl, so it travels as one shell-safe token. It carries the per-run salt, the
HMAC key of the coordinator protocol, so it is a secret: it goes to ranks by
environment or stdin, never argv.

The prebuild envelope (``FLODL_INTERNAL_PREBUILD_PER_HOST``) is plain JSON set
by a build step on the controller: for a host listed there, the rank runs a
prebuilt binary instead of the command's program.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..rank import (
    ENV_CLUSTER_JSON,
    ENV_CLUSTER_KEY,
    ENV_HOST_NAME,
    ENV_LOCAL_RANK,
    ENV_NET_TIMEOUT_SCALE,
    ENV_RUN_ID,
    ENV_VERBOSITY,
)

#: Set by a build step on the controller: prebuilt binaries by host (plain JSON).
ENV_PREBUILD = "FLODL_INTERNAL_PREBUILD_PER_HOST"

__all__ = ["ENV_CLUSTER_JSON", "ENV_CLUSTER_KEY", "ENV_HOST_NAME", "ENV_LOCAL_RANK",
           "ENV_NET_TIMEOUT_SCALE", "ENV_PREBUILD", "ENV_RUN_ID", "ENV_VERBOSITY"]

SALT_BYTES = 16


class EnvelopeError(ValueError):
    """An envelope could not be read; the message says which and why."""


def new_salt() -> bytes:
    """A fresh per-run salt: the coordinator's HMAC key and the run's token."""
    return secrets.token_bytes(SALT_BYTES)


def new_run_id() -> str:
    """A run id that sorts by start time and is unique across launchers."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def encode_hex(obj: Mapping[str, Any]) -> str:
    """Canonical JSON (sorted keys, no spaces), as lowercase hex."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8").hex()


def decode_hex(text: str) -> dict[str, Any]:
    """Inverse of `encode_hex`; accepts either case, rejects odd length."""
    try:
        raw = bytes.fromhex(text.strip())
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise EnvelopeError(f"envelope is not hex-encoded JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EnvelopeError("envelope must encode a JSON object")
    return obj


@dataclass(frozen=True)
class SlimEnvelope:
    """The per-worker view of the run that every rank on that worker receives.

    ``controller_host`` is the address *as that worker must dial it*:
    127.0.0.1 for tunneled workers, for example.
    """

    run_id: str
    controller_host: str
    controller_port: int
    world_size: int
    num_workers: int
    host: str
    ranks: tuple[int, ...]
    local_devices: Optional[tuple[int, ...]]
    nccl_socket_ifname: Optional[str]
    path: str
    salt: bytes

    def __post_init__(self) -> None:
        if len(self.salt) != SALT_BYTES:
            raise EnvelopeError(f"salt must be {SALT_BYTES} bytes, got {len(self.salt)}")
        if not self.ranks or any(not 0 <= r < self.world_size for r in self.ranks):
            raise EnvelopeError(f"ranks {list(self.ranks)} must be in 0..{self.world_size - 1}")
        if not 0 < self.num_workers <= self.world_size:
            raise EnvelopeError("num_workers must be in 1..world_size")

    def to_json(self) -> dict[str, Any]:
        devices: Union[list[int], None] = (
            list(self.local_devices) if self.local_devices is not None else None
        )
        return {
            "run_id": self.run_id,
            "controller": {"host": self.controller_host, "port": self.controller_port},
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "worker": {
                "host": self.host,
                "ranks": list(self.ranks),
                "local_devices": devices,
                "nccl_socket_ifname": self.nccl_socket_ifname or "",
                "path": self.path,
            },
            "salt": self.salt.hex(),
        }

    def to_hex(self) -> str:
        return encode_hex(self.to_json())

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SlimEnvelope:
        try:
            worker = obj["worker"]
            controller = obj["controller"]
            devices = worker.get("local_devices")
            return cls(
                run_id=str(obj.get("run_id", "")),
                controller_host=str(controller["host"]),
                controller_port=int(controller["port"]),
                world_size=int(obj["world_size"]),
                num_workers=int(obj["num_workers"]),
                host=str(worker["host"]),
                ranks=tuple(int(r) for r in worker["ranks"]),
                local_devices=tuple(int(d) for d in devices) if devices is not None else None,
                nccl_socket_ifname=worker.get("nccl_socket_ifname") or None,
                path=str(worker.get("path", "")),
                salt=bytes.fromhex(str(obj.get("salt", "00" * SALT_BYTES))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvelopeError(f"malformed envelope: {exc!r}") from None

    @classmethod
    def from_hex(cls, text: str) -> SlimEnvelope:
        return cls.from_json(decode_hex(text))


@dataclass(frozen=True)
class PrebuiltBinary:
    """A prebuilt binary for one host (flodl spec section 4.7)."""

    bin: str
    ld_library_path: str
    cwd_subpath: str = ""

    def program(self, path: str) -> str:
        """Absolute binary path, so it does not depend on the cwd offset."""
        return f"{path.rstrip('/')}/{self.bin}"

    def cwd(self, path: str) -> str:
        return f"{path.rstrip('/')}/{self.cwd_subpath}" if self.cwd_subpath else path


def parse_prebuilt(raw: Optional[str]) -> dict[str, PrebuiltBinary]:
    """Parse ``FLODL_INTERNAL_PREBUILD_PER_HOST``; unset or blank means none.

    Bad JSON is loud: it means the controller's build step is broken, and
    silently running the fallback program would hide that.
    """
    if raw is None or not raw.strip():
        return {}
    prefix = f"cluster launcher: parse {ENV_PREBUILD} JSON"
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise EnvelopeError(f"{prefix}: {exc}") from None
    if not isinstance(data, dict):
        raise EnvelopeError(f"{prefix}: expected an object keyed by host")
    entries: dict[str, PrebuiltBinary] = {}
    for host, entry in data.items():
        if not isinstance(entry, dict):
            raise EnvelopeError(f"{prefix}: entry for host {host!r} must be an object")
        unknown = set(entry) - {"bin", "ld_library_path", "cwd_subpath"}
        if unknown:
            raise EnvelopeError(f"{prefix}: host {host!r} has unknown keys {sorted(unknown)}")
        if not isinstance(entry.get("bin"), str) or not entry["bin"]:
            raise EnvelopeError(f"{prefix}: host {host!r} needs a non-empty string 'bin'")
        ld = entry.get("ld_library_path", "")
        sub = entry.get("cwd_subpath", "")
        if not isinstance(ld, str) or not isinstance(sub, str):
            raise EnvelopeError(
                f"{prefix}: host {host!r}: ld_library_path and cwd_subpath must be strings"
            )
        entries[host] = PrebuiltBinary(bin=entry["bin"], ld_library_path=ld, cwd_subpath=sub)
    return entries


def prebuilt_from_environ(environ: Optional[Mapping[str, str]] = None) -> dict[str, PrebuiltBinary]:
    env = os.environ if environ is None else environ
    return parse_prebuilt(env.get(ENV_PREBUILD))

"""``fdl-fabric join`` and ``fdl-fabric start``: their flags checked (a bad one is exit 2
naming it), then `join.join` or an operator's request (`join.ask_window`).

The token never comes from the command line (``ps`` shows argv to every user): a file
of the user's, 0600 (``--token-file``), or ``FDL_FABRIC_TOKEN``. ``start`` on the
launcher's machine needs neither: the run's record says where its window listens and
holds its token.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Optional

from ..errors import EXIT_USAGE, FdlError, usage
from ..joinwire import ENV_TOKEN, JoinError, parse_token, read_token_file
from ..limits import RANKS_PER_WORKER_MAX
from ..runs import place
from . import flags
from .join import EXIT_PERMANENT, EXIT_TRANSIENT, JoinRequest, Outcome, ask_window, join

#: The record's note of where its window listens (`commands.joinwindow` writes it).
WINDOW_NOTE = "join.json"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _token(token_file: Optional[str]) -> bytes:
    try:
        if token_file:
            return read_token_file(token_file)
        text = os.environ.get(ENV_TOKEN)
        if text:
            return parse_token(text, ENV_TOKEN)
    except JoinError as exc:
        raise usage("--token-file", str(exc)) from None
    raise usage("--token-file", f"the window's token is needed: --token-file FILE "
                      f"(yours, mode 0600) or {ENV_TOKEN}; never on the command line")


def _devices(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """``--devices``: ``0,1`` or ``all`` (this host's GPUs, as nvidia-smi lists them)."""
    if text is None:
        return None
    if text.strip() == "all":
        from ..agent.gpus import gpu_indices

        found = gpu_indices()
        if not found.get("gpus"):
            raise usage("--devices", f"all: this host has no GPU to offer "
                              f"({found.get('gpu_error') or 'none listed'})")
        return tuple(found["gpus"])
    words = [w.strip() for w in text.split(",")]
    if not words or not all(w.isascii() and w.isdigit() for w in words):
        raise usage("--devices", f"expected GPU numbers like 0,1 or all, got {text!r}")
    return tuple(int(w) for w in words)


def join_request(given: dict[str, Any]) -> JoinRequest:
    """The request of ``fdl-fabric join``'s flags; a bad one is exit 2 naming it."""
    controller = given.get("controller")
    if not controller:
        raise usage("--controller", "the join window's HOST:PORT is needed "
                          "(fdl-fabric join HOST:PORT)")
    address, port = flags.endpoint("--controller", str(controller))
    nproc = flags.whole("--nproc", given.get("nproc"), RANKS_PER_WORKER_MAX)
    devices = _devices(given.get("devices"))
    if nproc is not None and devices is not None:
        raise usage("--nproc", "give --nproc (CPU ranks) or --devices (GPUs), not both")
    path = str(given.get("path") or os.getcwd())
    if not os.path.isdir(path):
        raise usage("--path", f"no such folder: {path}")
    host = str(given.get("host") or socket.gethostname())
    return JoinRequest(address=address.strip("[]"), port=port,
                       token=_token(given.get("token_file")), host=host, nproc=nproc,
                       devices=devices, path=os.path.abspath(path),
                       run_id=given.get("run_id") or None)


def run_join(given: dict[str, Any]) -> int:
    """``fdl-fabric join``: its exit code (0 done, 1 transient, 2 permanent)."""
    try:
        request = join_request(given)
    except FdlError as exc:
        _say(f"fdl-fabric join: {exc}")
        return EXIT_USAGE
    return join(request, persist=bool(given.get("persist")), say=_say)


def _window_note(folder: Path) -> tuple[str, str]:
    """The window's address and token file, as its run's record keeps them."""
    note = json.loads((folder / WINDOW_NOTE).read_text())
    return str(note["address"]), str(note["token_file"])


def _operator(controller: str, token_file: Optional[str]) -> JoinRequest:
    """An operator's request to the window at ``controller`` (HOST:PORT)."""
    address, port = flags.endpoint("--controller", controller)
    return JoinRequest(address=address.strip("[]"), port=port, token=_token(token_file),
                       host="operator")


def _from_record(run: Optional[str]) -> tuple[str, Optional[str]]:
    """The window's address and token file, from the run's record on this machine."""
    try:
        return _window_note(place.find(run))
    except (LookupError, OSError, ValueError, KeyError, TypeError) as exc:
        raise usage("--run-id", f"no join window of that run here ({exc}): give "
                          "--controller HOST:PORT and --token-file FILE") from None


def run_start(given: dict[str, Any], what: str = "start") -> int:
    """``fdl-fabric start``: arm a manual or hybrid window (0 armed, 1 refused or no
    window, 2 bad input); with ``what="status"``, show it (`fdl-fabric status
    --controller`: 0 shown, 1 no window answered)."""
    try:
        controller, token_file = given.get("controller"), given.get("token_file")
        if not controller:
            controller, recorded = _from_record(given.get("run_id"))
            token_file = token_file or recorded
        request = _operator(str(controller), token_file)
        address, port = request.address, request.port
    except FdlError as exc:
        _say(f"fdl-fabric {what}: {exc}")
        return EXIT_USAGE
    try:
        answer = ask_window(request, what)
    except Outcome as outcome:
        if what == "status":
            show_window(f"{address}:{port}", {"error": str(outcome)},
                        as_json=bool(given.get("json")))
        else:
            _say(f"fdl-fabric {what}: {outcome}")
        return EXIT_USAGE if outcome.code == EXIT_PERMANENT else EXIT_TRANSIENT
    if "refuse" in answer:
        _say(f"fdl-fabric {what}: refused: {str(answer['refuse'])[:500]}")
        return EXIT_TRANSIENT
    if what == "status":
        show_window(f"{address}:{port}", answer, as_json=bool(given.get("json")))
    else:
        _say(f"fdl-fabric start: the window at {address}:{port} is started")
    return 0


def show_window(address: str, answer: dict[str, Any], *, as_json: bool) -> None:
    """One window's status, as words (`presentation.joinwords`) or one JSON object."""
    from ..events import EventBus, Name
    from ..presentation.output import Console

    console = Console()
    data = ({"address": address, "error": str(answer.get("refuse") or answer["error"])}
            if "refuse" in answer or "error" in answer
            else {"address": address, "window": answer.get("status") or {}})
    if as_json:
        console.json({"join_window": data})
    else:
        EventBus(console)(Name.JOIN_WINDOW_VIEW, **data)


def local_windows(as_json: bool) -> None:
    """``fdl-fabric status`` on the launcher's machine: the window of each live run of
    this controller that has one, asked over its proofs (bounded: a window that does not
    answer is said so)."""
    from ..runs.reading import view

    try:
        folders = place.records()
    except OSError:
        return
    for folder in folders:
        note = folder / WINDOW_NOTE
        if not note.exists() or not view(folder).alive:
            continue
        address = "?"
        try:
            address, token_file = _window_note(folder)
            answer = ask_window(_operator(address, token_file), "status")
        except (OSError, ValueError, KeyError, TypeError, FdlError, Outcome) as exc:
            answer = {"error": str(exc)}
        show_window(address, answer, as_json=as_json)


"""``--on HOST``: the run's controller is a machine that stays up, not this laptop.

``fdl-fabric launch --detach --on head …`` starts the run's detached supervisor on
``head`` over SSH (a Fabric Connection, reached as ``--hosts`` reaches a host: ssh_config,
``user@host:port``), where fdl-fabric is installed: closing the laptop then changes
nothing. ``attach``, ``logs``, ``stop``, ``wait`` and ``status`` with ``--on head`` run
there, over the same kind of connection, their output and exit code relayed.

Before anything starts, the versions are compared (``python3 -m fdl_fabric --version``
on ``head``): a different one, or none, is refused with the command that installs the
same, as flodl's ``fdl join`` prepares a box before it dials. The cluster file goes
with the launch, and the flags as given (JSON, in a 0600 file of a 0700 folder of that
user's, read and removed by ``head``: never in argv); ``head`` builds the options with
the same builder (`options.launch_options`), and its refusals are this command's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any, Optional

from .. import __version__, shell
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus
from ..presentation.output import Console
from ..transport import Transport, for_cluster, resolve_settings
from . import vocabulary

#: The interpreter that runs fdl-fabric on the other host.
REMOTE_PYTHON = "python3"
#: Where the launch's cluster file and flags are put on that host, under its home.
STAGED = ".local/state/fdl-fabric/staged"
#: The flags file's name in the staged folder.
OPTIONS = "options.json"


def connect(on: str) -> Transport:
    """A connection to ``on`` (``[user@]host[:port]``, through ~/.ssh/config) that gives a
    shell (`Transport.shell`); a host that cannot be reached is an `FdlError` saying why,
    and this machine is refused (it has no shell to reach: leave ``--on`` out)."""
    from .options import hosts_cluster

    cluster = hosts_cluster({"hosts": on}, command="status")
    assert cluster is not None
    settings = resolve_settings(cluster, EventBus(Console()))
    transport = next(iter(for_cluster(cluster, settings).values()))
    if transport.this_machine:
        raise FdlError(f"--on {on}: is this machine: leave --on out", EXIT_USAGE)
    try:
        transport.connect()
    except Exception as exc:
        raise FdlError(f"--on {on}: {exc}") from None
    if transport.shell() is None:
        transport.close()
        raise FdlError(f"--on {on}: {transport.describe()} gives no shell to run "
                       "fdl-fabric on", EXIT_USAGE)
    return transport


def check_version(transport: Transport, on: str) -> None:
    """The same fdl-fabric on ``on`` as here, or the command that installs it."""
    conn = transport.shell()
    assert conn is not None
    done = conn.run(f"{REMOTE_PYTHON} -m fdl_fabric --version", warn=True, hide=True,
                    in_stream=False)
    theirs = done.stdout.strip().rpartition(" ")[2] if done.ok else None
    if theirs == __version__:
        return
    install = f"{REMOTE_PYTHON} -m pip install fdl-fabric=={__version__}"
    if theirs is None:
        why = (done.stderr.strip().splitlines() or ["not found"])[-1]
        raise FdlError(f"--on {on}: fdl-fabric is not installed for {REMOTE_PYTHON} there "
                       f"({why}); install it there: ssh {on} {install}")
    raise FdlError(f"--on {on}: fdl-fabric {theirs} is installed there, this is "
                   f"{__version__}: install the same there: ssh {on} {install}")


def words_of(command: str, given: Mapping[str, Any], drop: Sequence[str] = ("on",)
             ) -> list[str]:
    """The flags as given, as command-line words again (for the same command there)."""
    words: list[str] = []
    for flag in vocabulary.flags_of(command):
        value = given.get(flag.name)
        if flag.name in drop or value is None:
            continue
        if flag.on_by_default:
            if value is False:
                words.append(flag.spellings[0])  # --no-...
        elif flag.counted:
            if value:
                words.append(f"{flag.long}={int(value)}")
        elif flag.metavar is None:
            if value:
                words.append(flag.long)
        else:
            words += [flag.long, str(value)]
    return words


def run_there(on: str, command: str, given: Mapping[str, Any], *, pty: bool = False) -> int:
    """``fdl-fabric COMMAND`` with the same flags on ``on``: its output here, its code."""
    return there(on, [command, *words_of(command, given)], pty=pty)[0]


def there(on: str, words: Sequence[str], *, pty: bool = False, hide: bool = False,
          read: Optional[str] = None) -> tuple[int, str, Optional[bytes]]:
    """``fdl-fabric WORDS`` on ``on`` (its exit code and stdout; shown here unless
    ``hide``), then the file ``read`` there, when asked (its bytes, None if missing)."""
    transport = connect(on)
    try:
        check_version(transport, on)
        argv = [REMOTE_PYTHON, "-m", "fdl_fabric", *words]
        conn = transport.shell()
        assert conn is not None
        done = conn.run(" ".join(shell.quote(w) for w in argv), warn=True, pty=pty,
                        hide=hide, in_stream=None if pty else False)
        data = None
        if read is not None:
            with conn.sftp() as sftp:
                try:
                    with sftp.open(read, "rb") as fh:
                        data = fh.read()
                except OSError:
                    data = None
        return int(done.exited), str(done.stdout), data
    finally:
        transport.close()


def launch_there(on: str, given: Mapping[str, Any], argv: Sequence[str],
                 cluster_file: Optional[str]) -> tuple[int, Optional[str]]:
    """``launch --detach --on HOST``: the cluster file and the flags to ``on``, the
    supervisor started there; what it says, its exit code (0 once every rank runs) and
    the run's id."""
    refuse_sync(on, given, cluster_file)
    transport = connect(on)
    try:
        check_version(transport, on)
        conn = transport.shell()
        assert conn is not None
        sftp = conn.sftp()
        home = sftp.normalize(".")
        folder = PurePosixPath(home) / STAGED / secrets.token_hex(8)
        _private_folders(sftp, PurePosixPath(home), folder)
        values = {k: v for k, v in given.items() if k not in ("on", "cluster")}
        if cluster_file is not None:
            remote = folder / os.path.basename(cluster_file)
            sftp.put(cluster_file, str(remote))
            sftp.chmod(str(remote), 0o600)
            values["cluster"] = str(remote)
        payload = json.dumps({"values": values, "argv": list(argv), "on": on,
                              "version": __version__}).encode("utf-8")
        with sftp.open(str(folder / OPTIONS), "wb") as fh:
            fh.chmod(0o600)
            fh.write(payload)
        sftp.close()
        start = [REMOTE_PYTHON, "-m", "fdl_fabric.commands.onhost", str(folder / OPTIONS)]
        done = conn.run(f"cd {shell.quote(str(folder))} && "
                        + " ".join(shell.quote(w) for w in start),
                        warn=True, hide=False, in_stream=False)
        said = re.search(r"run (\S+) goes on detached", str(done.stdout))
        return int(done.exited), said.group(1) if said else None
    finally:
        transport.close()


def refuse_sync(on: str, given: Mapping[str, Any], cluster_file: Optional[str]) -> None:
    """``--on`` carries the cluster file, not the folder ``sync:`` would send from this
    machine: a sync from there would send the wrong folder, so it is refused (exit 2)."""
    if given.get("no_sync"):
        return
    wanted = bool(given.get("sync"))
    if not wanted and cluster_file is not None and os.path.isfile(cluster_file):
        from ..clusterfile import load_cluster

        try:
            wanted = load_cluster(cluster_file).sync is not None
        except FdlError:
            return  # the launch there says what is wrong with the file
    if wanted:
        raise FdlError(f"--on: sync sends a folder of this machine, and only the cluster "
                       f"file goes to {on}: run the launch from a checkout on {on} (ssh {on} "
                       "fdl-fabric launch --detach --sync ...), or add --no-sync", EXIT_USAGE)


def _private_folders(sftp: Any, home: PurePosixPath, folder: PurePosixPath) -> None:
    """``folder`` and what is missing above it under ``home``, each 0700."""
    path = home
    for part in folder.relative_to(home).parts:
        path = path / part
        try:
            sftp.stat(str(path))
        except OSError:
            sftp.mkdir(str(path), 0o700)
    sftp.chmod(str(folder), 0o700)


def main(options_file: str) -> int:
    """On the host that stays up: the staged flags, through the one builder, detached."""
    from .detach import launch_detached
    from .options import launch_options, refuse

    with open(options_file, encoding="utf-8") as fh:
        payload = json.load(fh)
    os.unlink(options_file)
    values = payload["values"]
    try:
        opts = launch_options(values, command="launch", argv=payload["argv"])
    except FdlError as exc:
        refuse(exc, None, as_json=bool(values.get("json")))
        return exc.exit_code
    return launch_detached(opts, "fdl-fabric", on=payload.get("on"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

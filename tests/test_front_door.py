"""One front door (issue 29, items 1-3): one vocabulary of flags for every command, one
builder of the launch (`commands.options`) behind inv, fdl-fabric and the Python API,
and hosts on the command line that say user, port, key and where ranks meet."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import fdl_fabric
from fdl_fabric.clusterfile import load_cluster
from fdl_fabric.clusterfile.hosts import HostsError, expand_hosts, split_entry
from fdl_fabric.commands import vocabulary
from fdl_fabric.commands.options import MASTER_PORT_DEFAULT, hosts_cluster, launch_options
from fdl_fabric.errors import FdlError
from fdl_fabric.tasks import ns
from fdl_fabric.transport.sshconfig import with_dialable_addrs

ROOT = Path(__file__).resolve().parent.parent
FDL = (sys.executable, "-m", "fdl_fabric")
INV = (sys.executable, "-m", "invoke", "--search-root", str(ROOT))
#: Commands that reach hosts, and plot-run, which reads a folder.
COMMANDS = [c for c in vocabulary.COMMANDS]


def _help(*argv: str) -> str:
    """A help page as a person gets it (``FDL``/``INV`` argv), printed in this process."""
    from invoke.program import Program

    from fdl_fabric.commands import cli

    out, err = io.StringIO(), io.StringIO()
    words = list(argv[argv.index("fdl_fabric") + 1:] if "fdl_fabric" in argv
                 else argv[argv.index(str(ROOT)) + 1:])
    binary = "fdl-fabric" if "fdl_fabric" in argv else "inv"
    with mock.patch.object(sys, "argv", [binary, *words]), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if binary == "fdl-fabric":
                cli.main([binary, *words])
            else:
                Program(namespace=ns, name="inv", binary="inv").run([binary, *words])
        except SystemExit as exc:
            assert exc.code in (0, None), err.getvalue()
    assert err.getvalue() == "", err.getvalue()
    return out.getvalue()


# -- one vocabulary ------------------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_lists_each_of_its_flags_as_the_vocabulary_spells_it(
        command: str) -> None:
    page = _help(*FDL, command, "--help")
    assert page.startswith(f"usage: fdl-fabric {command}")
    assert "  -h, --help" in page, "-h is help everywhere"
    for flag in vocabulary.flags_of(command):
        row = ", ".join(sorted(flag.spellings, key=len))
        assert f"  {row}" in page, (command, row)
        if flag.metavar:
            assert f"{row} {flag.metavar}" in page, "each value's kind is shown"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "run"])
def test_inv_and_fdl_fabric_print_one_help_page_and_parse_the_same_flags(command: str) -> None:
    ours = _help(*FDL, command, "--help").split("\n", 1)[1]
    invs = _help(*INV, command, "--help").split("\n", 1)[1]
    assert ours == invs
    task = ns.tasks[command]
    parsed = {n if len(n) > 1 else n for a in task.get_arguments() for n in a.names}
    for flag in vocabulary.flags_of(command):
        assert flag.name in {n.replace("-", "_") for n in parsed}, (command, flag.name)
        if flag.short:
            assert flag.short in parsed, (command, flag.short)
    assert "h" not in parsed, "-h is help, never a flag of a task"


def test_a_flag_shared_by_commands_has_one_short_form_and_one_meaning() -> None:
    by_short: dict[str, set[str]] = {}
    for flag in vocabulary.FLAGS:
        if flag.short:
            by_short.setdefault(flag.short, set()).add(flag.name)
    assert all(len(names) == 1 for names in by_short.values()), by_short
    hosted = {"hosts": "H", "ssh_config": "F", "cluster": "c", "identity": "i", "user": "l",
              "port": "p"}
    for name, short in hosted.items():
        assert vocabulary.BY_NAME[name].short == short
    for command in ("launch", "cleanup", "prebuild-check", "stacks", "status"):
        names = {f.name for f in vocabulary.flags_of(command)}
        assert {"cluster", "hosts", "hostfile", "ssh_config", "identity", "user",
                "port"} <= names, command
    assert "dry_run" in {f.name for f in vocabulary.flags_of("run")}


def test_help_into_a_reader_that_stops_early_is_no_error() -> None:
    for argv in ([*FDL, "launch", "--help"], [*INV, "launch", "--help"],
                 [*FDL, "run", "--help"], [*FDL, "--help"]):
        done = subprocess.run(["sh", "-c", " ".join(argv) + " | head -1"],
                              capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert done.returncode == 0 and "BrokenPipe" not in done.stderr, done.stderr
        assert done.stderr == "", done.stderr


def test_inv_lists_run_beside_the_other_commands() -> None:
    listed = _help(*INV, "--list")
    for command in COMMANDS:
        assert f"  {command} " in listed, command


def test_a_refusal_under_json_is_a_record_on_stdout_and_one_line_on_stderr() -> None:
    for argv in ([*FDL, "launch", "--json", "--kill-grace", "abc"],
                 [*INV, "launch", "-j", "--kill-grace", "abc"],
                 [*FDL, "run", "--json", "--master-port", "0", "x.py"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert done.returncode == 2
        (record,) = [json.loads(line) for line in done.stdout.splitlines()]
        assert record["v"] == 1 and record["name"] == "refused"
        flag = "--kill-grace" if "--kill-grace" in argv else "--master-port"
        assert flag in record["data"]["error"]
        assert len(done.stderr.splitlines()) == 1 and flag in done.stderr


# -- hosts on the command line ----------------------------------------------------------------

@pytest.mark.parametrize(("entry", "parsed"), [
    ("gpu1", (None, "gpu1", None)),
    ("root@gpu[1-4]:2222", ("root", "gpu[1-4]", 2222)),
    ("127.4.0.21:6301", (None, "127.4.0.21", 6301)),
    ("alice@[fd00::1]:22", ("alice", "fd00::1", 22)),
    ("[fd00::1]", (None, "fd00::1", None)),
    ("fd00::1", (None, "fd00::1", None)),
])
def test_a_hosts_entry_says_user_host_and_port_as_ssh_takes_them(
        entry: str, parsed: tuple[object, ...]) -> None:
    assert split_entry(entry, "--hosts") == parsed


def test_a_range_carries_its_user_and_port_to_every_host() -> None:
    slots = expand_hosts("root@gpu[1-2]:2222,[fd00::1]:22,cpu1")
    assert [(s.user, s.host, s.port) for s in slots] == [
        ("root", "gpu1", 2222), ("root", "gpu2", 2222), (None, "fd00::1", 22),
        (None, "cpu1", None)]


@pytest.mark.parametrize(("text", "words"), [
    ("gpu1:99999", "port must be a number from 1 to 65535, got '99999'"),
    ("gpu1:", "port must be a number from 1 to 65535, got ''"),
    ("@gpu1", "empty user before '@'"),
    ("[fd00::1]x", "expected [ipv6]:port"),
])
def test_a_bad_hosts_entry_is_refused_naming_it(text: str, words: str) -> None:
    with pytest.raises(HostsError, match=words.replace("[", r"\[").replace("(", r"\(")):
        expand_hosts(text)


def test_user_port_and_identity_reach_every_host_unless_its_entry_says_otherwise(
        tmp_path: Path) -> None:
    key = tmp_path / "id"
    key.write_text("not read here")
    cluster = hosts_cluster({"hosts": "bob@127.0.0.2:2200,127.0.0.3", "user": "root",
                             "port": "2222", "identity": str(key)}, command="status")
    assert cluster is not None
    assert [(w.ssh.user, w.ssh.port, w.ssh.identity_file) for w in cluster.workers] == [
        ("bob", 2200, str(key)), ("root", 2222, str(key))]
    assert cluster.named_by == "--hosts"


def test_an_ssh_config_alias_is_its_hostname_for_the_ranks(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host node1\n  HostName 127.0.0.5\nHost node2\n  HostName 127.0.0.6\n")
    opts = launch_options({"hosts": "node[1-2]", "ssh_config": str(config)},
                          command="launch", argv=["true"])
    assert opts.cluster is not None
    dialable = with_dialable_addrs(opts.cluster)  # what the launch does before its plan
    assert [w.addr for w in dialable.workers] == ["127.0.0.5", "127.0.0.6"]
    honoured = launch_options({"hosts": "node[1-2]", "ssh_config": str(config),
                               "master_addr": "127.0.0.9"}, command="launch", argv=["true"])
    assert honoured.cluster is not None
    assert [w.addr for w in with_dialable_addrs(honoured.cluster).workers] == [
        "127.0.0.9", "127.0.0.6"]


def test_a_cluster_files_alias_is_its_hostname_unless_addr_says_otherwise(
        tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host trainbox\n  HostName 127.0.0.7\n")
    path = tmp_path / "cluster.yml"
    common = f"    nproc: 1\n    path: /tmp\n    ssh: {{config_file: {config}}}\n"
    path.write_text(f"workers:\n  - host: trainbox\n{common}"
                    f"  - host: evalbox\n    addr: 127.0.0.8\n{common}")
    cluster = with_dialable_addrs(load_cluster(str(path)))
    assert [w.addr for w in cluster.workers] == ["127.0.0.7", "127.0.0.8"]


def test_the_coordinator_port_is_free_unless_given_and_rdzv_endpoint_places_it() -> None:
    picked = {launch_options({"hosts": "127.0.0.2"}, command="launch",
                             argv=["true"]).cluster.controller.port for _ in range(3)}  # type: ignore[union-attr]
    assert 1337 not in picked and len(picked) > 1, "a free port each time, never a fixed one"
    given = launch_options({"hosts": "127.0.0.2", "controller_port": "29400"},
                           command="launch", argv=["true"]).cluster
    assert given is not None and given.controller.port == 29400
    torchrun = launch_options({"hosts": "127.0.0.2", "rdzv_endpoint": "127.0.0.1:29401"},
                              command="run", argv=["true"]).cluster
    assert torchrun is not None
    assert (torchrun.controller.host, torchrun.controller.port) == ("127.0.0.1", 29401)


def test_master_port_is_free_on_this_machine_and_torchruns_across_machines() -> None:
    here = launch_options({"hosts": "localhost,127.0.0.2"}, command="launch",
                          argv=["true"]).cluster
    assert here is not None and here.master_port != MASTER_PORT_DEFAULT
    away = launch_options({"hosts": "gpu1.invalid,gpu2.invalid"}, command="launch",
                          argv=["true"]).cluster
    assert away is not None and away.master_port == MASTER_PORT_DEFAULT


@pytest.mark.parametrize(("values", "words"), [
    ({"user": "root"}, "-l/--user: only with --hosts or --hostfile (a cluster file sets "
                       "ssh.user per worker; -l is no longer --log-dir: write --log-dir)"),
    ({"controller_port": "29400"}, "--controller-port: only with --hosts or --hostfile "
                                   "(a cluster file sets controller.port)"),
    ({"hosts": "a", "rdzv_endpoint": "nowhere"}, "--rdzv-endpoint: expected HOST:PORT"),
    ({"hosts": "a", "rdzv_endpoint": "h:1", "controller_port": "2"},
     "--rdzv-endpoint: give it or --controller-port, not both"),
    ({"hosts": "a", "port": "0"}, "--port: port must be a number from 1 to 65535"),
    ({"hosts": "a", "identity": "/nonexistent/key"}, "--identity: /nonexistent/key is not "
                                                      "a file"),
])
def test_a_host_flag_that_cannot_apply_is_refused_naming_it(
        values: dict[str, str], words: str) -> None:
    with pytest.raises(FdlError) as caught:
        launch_options(values, command="launch", argv=["true"])
    assert caught.value.exit_code == 2 and words in str(caught.value)


# -- the Python API ---------------------------------------------------------------------------

def test_the_api_offers_every_option_the_command_line_has() -> None:
    params = set(inspect.signature(fdl_fabric.launch).parameters)
    spelled = {"cmd": "command", "verbose": "verbosity", "no_sync": "sync"}
    for flag in vocabulary.flags_of("launch"):
        assert spelled.get(flag.name, flag.name) in params, flag.name


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"hosts": "a,a"}, "--hosts: host 'a' is named twice"),
    ({"hosts": "a", "kill_grace": -1}, "--kill-grace"),
    ({"hosts": "a", "controller_port": 70000}, "--controller-port"),
    ({"hosts": "a", "max_failure": "200%"}, "--max-failure"),
])
def test_the_api_refuses_what_the_command_line_refuses_by_the_same_words(
        kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(FdlError) as caught:
        fdl_fabric.launch(None, "true", **kwargs)  # type: ignore[arg-type]
    assert caught.value.exit_code == 2 and words in str(caught.value)


def test_docs_cli_md_has_the_one_flag_table_of_every_command() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    table = page.split("<!-- flags:begin -->\n", 1)[1].split("<!-- flags:end -->", 1)[0]
    assert table == vocabulary.markdown_table(), \
        "docs/cli.md's table is vocabulary.markdown_table(): paste it again"


def test_the_api_dry_run_takes_every_host_and_rendezvous_option_and_starts_nothing(
        tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("not read by a dry run")
    config = tmp_path / "ssh_config"
    config.write_text("Host node1\n  HostName 127.0.0.5\n")
    seen: list[object] = []
    result = fdl_fabric.launch(
        None, ["python3", "train.py"], hosts="node1,bob@127.0.0.6:2200", ssh_config=config,
        user="root", port=2222, identity=key, nproc_per_node=2, master_port=29510,
        controller_addr="127.0.0.1", rdzv_endpoint=None, controller_port=29410,
        kill_grace=3, max_failure="25%", max_restarts=1, agent_timeout=8, hang_timeout=60,
        fanout=8, preflight=False, env={"FOO": "bar"}, verbosity=1, quiet=True,
        dry_run=True, on_event=seen.append)
    assert (result.verdict, result.exit_code, result.run_id) == ("dry-run", 0, None)
    (plan,) = [e for e in seen if getattr(e, "name").value == "dry_run"]  # noqa: B009
    text = json.dumps(plan.data, default=str)  # type: ignore[attr-defined]
    for fact in ("127.0.0.5", "bob", "2200", "2222", "29510", "29410"):
        assert fact in text, fact


def test_ports_picked_together_are_never_the_same_one_twice() -> None:
    from fdl_fabric.commands.flags import free_ports

    assert len(set(free_ports(64))) == 64
    for _ in range(20):  # the coordinator's and rank 0's store: two ports, always
        cluster = launch_options({}, command="run", argv=["true"]).cluster
        assert cluster is not None and cluster.controller.port != cluster.master_port

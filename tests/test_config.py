"""Specification of cluster.yml: what a valid file means, and how each mistake is reported."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shlex
import tempfile
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fdl_fabric.clusterfile import (
    ENV_NAME_RE,
    RESERVED_ENV_KEYS,
    ClusterSpec,
    ConfigError,
    ControllerSpec,
    ElasticSpec,
    Problem,
    SshSpec,
    WorkerSpec,
    is_reserved_env_key,
    load_cluster,
    parse_cluster,
    parse_max_failure,
    this_host_name,
)
from fdl_fabric.clusterfile import yamlnodes as yamlread
from fdl_fabric.clusterfile.names import host_name_problem
from fdl_fabric.limits import (
    ARG_STRLEN_MAX,
    COMMAND_MAX_BYTES,
    DEPTH_MAX,
    ENV_NAME_MAX,
    ENV_VARS_MAX,
    FILE_MAX_BYTES,
    PATH_MAX_BYTES,
    PROBLEMS_MAX,
    RANKS_MAX,
    RANKS_PER_WORKER_MAX,
    SSH_OPTIONS_MAX,
    WORKERS_MAX,
)
from fdl_fabric.shell import shell_words

FOLDER = "/srv/cluster"
LOCAL = "launcher"  # the name of "this machine" in every test unless said otherwise


def yml(text: str) -> str:
    """Dedent so that line 1 is the first line after the opening quotes."""
    return textwrap.dedent(text).lstrip("\n")


def parse(text: str, **kwargs: Any) -> ClusterSpec:
    kwargs.setdefault("folder", FOLDER)
    kwargs.setdefault("local_hostname", LOCAL)
    return parse_cluster(yml(text), **kwargs)


def error(text: str, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text, **kwargs)
    return info.value


def problem_at(err: ConfigError, key: str) -> Problem:
    matches = [p for p in err.problems if p.key == key]
    assert len(matches) == 1, f"expected one problem at {key!r}, got:\n{err}"
    return matches[0]


def worker(text: str, **kwargs: Any) -> WorkerSpec:
    """Parse a file with a single worker given as the body of its mapping."""
    body = textwrap.indent(yml(text), "    ").lstrip()
    return parse(f"workers:\n  - {body}", **kwargs).workers[0]


def worker_error(text: str, **kwargs: Any) -> ConfigError:
    body = textwrap.indent(yml(text), "    ").lstrip()
    return error(f"workers:\n  - {body}", **kwargs)


# --------------------------------------------------------------------------------------------
# A valid file and its defaults
# --------------------------------------------------------------------------------------------

REALISTIC = """
# Two GPU boxes and a CPU helper, launched from gpu1.
controller:
  host: 10.0.0.1
  port: 7000
command: python train.py --config "configs/big run.yml"
env:
  NCCL_DEBUG: WARN
  FLODL_VERBOSITY: "2"
kill_grace: 15.5
master_port: 29600
elastic:
  max_failure: 25%
  formation_timeout: 600
  heartbeat_timeout: 12.5
workers:
  - host: gpu1
    local_devices: all
    data_path: data
    env: {OMP_NUM_THREADS: "8"}
  - host: gpu2
    local_devices: [0, 1, 3]
    path: /opt/job
    nccl_socket_ifname: ib0
    ssh:
      target: 10.0.0.2
      user: trainer
      port: 2222
      identity_file: keys/id_ed25519
      options: [StrictHostKeyChecking=accept-new, ServerAliveInterval=15]
    tunnel: true
  - host: cpu-helper
    nproc: 4
    path: ~/jobs/helper
    addr: 10.0.0.9
"""


def test_realistic_file_loads_every_field(tmp_path: Path) -> None:
    file = tmp_path / "cluster.yml"
    file.write_text(yml(REALISTIC), encoding="utf-8")
    folder = str(tmp_path)

    spec = load_cluster(file, local_hostname="gpu1")

    assert spec.file == str(file)
    assert spec.folder == folder
    assert spec.controller == ControllerSpec(host="10.0.0.1", port=7000)
    assert spec.command == 'python train.py --config "configs/big run.yml"'
    assert spec.env == {"NCCL_DEBUG": "WARN", "FLODL_VERBOSITY": "2"}
    assert spec.kill_grace == 15.5
    assert spec.master_port == 29600
    assert spec.elastic == ElasticSpec(
        max_failure=0.25, formation_timeout=600.0, heartbeat_timeout=12.5
    )
    assert spec.workers == (
        WorkerSpec(
            index=0,
            host="gpu1",
            nproc=None,
            local_devices="all",
            path=folder,
            addr="10.0.0.1",
            nccl_socket_ifname=None,
            ssh=SshSpec(),
            tunnel=False,
            env={"OMP_NUM_THREADS": "8"},
            data_path=os.path.join(folder, "data"),
            is_local=True,
            line=16,
        ),
        WorkerSpec(
            index=1,
            host="gpu2",
            nproc=None,
            local_devices=(0, 1, 3),
            path="/opt/job",
            addr="10.0.0.2",
            nccl_socket_ifname="ib0",
            ssh=SshSpec(
                target="10.0.0.2",
                user="trainer",
                port=2222,
                identity_file=os.path.join(folder, "keys", "id_ed25519"),
                options=("StrictHostKeyChecking=accept-new", "ServerAliveInterval=15"),
            ),
            tunnel=True,
            env={},
            data_path=None,
            is_local=False,
            line=20,
        ),
        WorkerSpec(
            index=2,
            host="cpu-helper",
            nproc=4,
            local_devices=None,
            path="~/jobs/helper",
            addr="10.0.0.9",
            nccl_socket_ifname=None,
            ssh=SshSpec(),
            tunnel=False,
            env={},
            data_path=None,
            is_local=False,
            line=31,
        ),
    )


def test_minimal_file_gets_the_documented_defaults() -> None:
    spec = parse("""
        workers:
          - host: launcher
            nproc: 2
    """)
    assert spec.controller == ControllerSpec(host="127.0.0.1", port=1337)
    assert spec.command is None
    assert spec.env == {}
    assert spec.kill_grace == 10.0
    assert spec.master_port == 29500
    assert spec.elastic == ElasticSpec(
        max_failure=None, formation_timeout=300.0, heartbeat_timeout=30.0
    )
    (w,) = spec.workers
    assert (w.nproc, w.local_devices, w.tunnel, w.env, w.data_path) == (2, None, False, {}, None)
    assert w.ssh == SshSpec()
    assert w.nccl_socket_ifname is None


def test_controller_block_may_set_only_one_field() -> None:
    spec = parse("""
        controller: {port: 4000}
        workers: [{host: launcher, nproc: 1}]
    """)
    assert spec.controller == ControllerSpec(host="127.0.0.1", port=4000)


@pytest.mark.parametrize(("written", "value"), [("0", 0.0), ("3", 3.0), ("2.5", 2.5)])
def test_kill_grace_accepts_any_non_negative_number(written: str, value: float) -> None:
    spec = parse(f"kill_grace: {written}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert spec.kill_grace == value


def test_workers_keep_file_order_and_index_is_the_group_rank() -> None:
    spec = parse("""
        workers:
          - {host: c, nproc: 1, path: /c}
          - {host: a, nproc: 1, path: /a}
          - {host: b, nproc: 1, path: /b}
    """)
    assert [(w.index, w.host) for w in spec.workers] == [(0, "c"), (1, "a"), (2, "b")]


def test_worker_line_is_the_line_of_its_mapping() -> None:
    spec = parse("""
        workers:
          - host: launcher
            nproc: 1

          - host: other
            nproc: 1
            path: /x
    """)
    assert [w.line for w in spec.workers] == [2, 5]


def test_ssh_target_falls_back_to_the_host_name() -> None:
    assert worker("host: gpu9\nnproc: 1\npath: /x").ssh_target == "gpu9"
    assert worker("host: gpu9\nnproc: 1\npath: /x\nssh: {target: 10.1.1.9}").ssh_target == (
        "10.1.1.9"
    )


def test_nccl_socket_ifname_is_an_optional_string_even_with_one_worker() -> None:
    assert worker(
        "host: launcher\nnproc: 1\nnccl_socket_ifname: ^lo,docker"
    ).nccl_socket_ifname == ("^lo,docker")


# --------------------------------------------------------------------------------------------
# How problems are reported
# --------------------------------------------------------------------------------------------


def test_problem_reads_file_line_key_message() -> None:
    problem = Problem("c.yml", "workers[0].nproc", 4, "must be >= 1, got 0")
    assert str(problem) == "c.yml:4: workers[0].nproc: must be >= 1, got 0"


def test_problem_without_a_line_omits_it() -> None:
    assert str(Problem("c.yml", "workers", None, "boom")) == "c.yml: workers: boom"


def test_problem_about_the_whole_file_omits_the_empty_key() -> None:
    assert str(Problem("c.yml", "", None, "file not found")) == "c.yml: file not found"


def test_config_error_lists_every_problem_one_per_line_sorted_by_line() -> None:
    err = error("""
        master_port: 0
        kill_grace: -1
        workers:
          - host: launcher
            nproc: 0
    """)
    assert [p.line for p in err.problems] == [1, 2, 5]
    assert str(err) == "\n".join(str(p) for p in err.problems)
    assert str(err).splitlines() == [
        "cluster.yml:1: master_port: must be between 1 and 65535, got 0",
        "cluster.yml:2: kill_grace: must be >= 0, got -1",
        "cluster.yml:5: workers[0].nproc: must be between 1 and 1024, got 0",
    ]


def test_config_error_survives_pickling_for_multiprocessing() -> None:
    err = error("master_port: 0\nworkers: [{host: launcher, nproc: 1}]")
    clone = pickle.loads(pickle.dumps(err))
    assert clone.problems == err.problems
    assert str(clone) == str(err)


def test_file_label_is_used_in_every_problem() -> None:
    err = error("master_port: x\nworkers: [{host: launcher, nproc: 1}]", file="conf/prod.yml")
    assert str(err).startswith("conf/prod.yml:1: master_port: ")


def test_missing_file_is_a_single_file_not_found_problem(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yml")
    with pytest.raises(ConfigError) as info:
        load_cluster(missing)
    assert info.value.problems == [Problem(missing, "", None, "file not found")]


def test_yaml_syntax_error_names_the_file_and_the_line() -> None:
    err = error("""
        workers:
          - host: launcher
            nproc: [1
          - host: other
    """)
    (problem,) = err.problems
    assert problem.file == "cluster.yml"
    assert problem.line == 4
    assert problem.message.startswith("invalid YAML: ")


def test_yaml_control_character_is_reported_with_its_line() -> None:
    err = error("workers:\n  - host: a\x07b\n")
    (problem,) = err.problems
    assert problem.line == 2
    assert problem.message.startswith("invalid YAML: unacceptable character #x0007")
    assert "\n" not in str(err)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_file_is_an_error(text: str) -> None:
    (problem,) = error(text).problems
    assert "empty" in problem.message


@pytest.mark.parametrize(
    ("text", "found"), [("- a\n- b\n", "a list"), ("just words\n", "string 'just words'")]
)
def test_top_level_must_be_a_mapping(text: str, found: str) -> None:
    (problem,) = error(text).problems
    assert problem.message == f"expected a mapping at the top level, got {found}"
    assert problem.line == 1


def test_several_yaml_documents_are_an_error() -> None:
    (problem,) = error("workers: []\n---\nworkers: []\n").problems
    assert problem.line == 2
    assert "single document" in problem.message


def test_duplicate_yaml_key_is_an_error_naming_the_first_line() -> None:
    err = worker_error("""
        host: launcher
        nproc: 1
        nproc: 2
    """)
    problem = problem_at(err, "workers[0].nproc")
    assert problem.line == 4
    assert problem.message == "duplicate key 'nproc' (first on line 3)"


def test_unknown_top_level_key_suggests_the_closest_known_key() -> None:
    err = error("kill_grase: 3\nworkers: [{host: launcher, nproc: 1}]")
    assert str(err) == (
        "cluster.yml:1: kill_grase: unknown key 'kill_grase' (did you mean 'kill_grace'?)"
    )


def test_unknown_key_far_from_every_known_key_gets_no_suggestion() -> None:
    err = error("zzz: 3\nworkers: [{host: launcher, nproc: 1}]")
    assert problem_at(err, "zzz").message == "unknown key 'zzz'"


@pytest.mark.parametrize(
    ("snippet", "key", "suggestion"),
    [
        ("hots: x", "workers[0].hots", "host"),
        ("ssh: {portt: 22}", "workers[0].ssh.portt", "port"),
        ("data-path: /d", "workers[0].data-path", "data_path"),
    ],
)
def test_unknown_worker_keys_are_errors_with_a_suggestion(
    snippet: str, key: str, suggestion: str
) -> None:
    err = worker_error(f"host: launcher\nnproc: 1\n{snippet}")
    assert problem_at(err, key).message.endswith(f"(did you mean {suggestion!r}?)")


@pytest.mark.parametrize(
    ("block", "key", "suggestion"),
    [
        ("controller: {hots: a}", "controller.hots", "host"),
        ("elastic: {max_failures: 1}", "elastic.max_failures", "max_failure"),
    ],
)
def test_unknown_keys_in_nested_blocks_are_errors_with_a_suggestion(
    block: str, key: str, suggestion: str
) -> None:
    err = error(f"{block}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert problem_at(err, key).message.endswith(f"(did you mean {suggestion!r}?)")


def test_all_problems_are_collected_in_one_pass() -> None:
    err = error("""
        controller: {port: 0}
        env: {"A B": x}
        workers:
          - host: launcher
            nproc: 1
            local_devices: [0]
          - host: gpu2
            nproc: 1
    """)
    assert [p.key for p in err.problems] == [
        "controller.port",
        'env["A B"]',
        "workers[0]",
        "workers[1].path",
    ]


# --------------------------------------------------------------------------------------------
# Types and ranges
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ("controller: {port: two}", "controller.port", "expected an integer, got string 'two'"),
        ("controller: {port: 80.0}", "controller.port", "expected an integer, got float 80.0"),
        ("controller: {host: 7}", "controller.host", "expected a string, got integer 7"),
        ("controller: [a]", "controller", "expected a mapping, got a list"),
        ("master_port: true", "master_port", "expected an integer, got boolean true"),
        ("kill_grace: yes", "kill_grace", "expected a number, got boolean yes"),
        ("kill_grace: '3'", "kill_grace", "expected a number, got string '3'"),
        ("command: 3", "command", "expected a string, got integer 3"),
        ("command: [python, x.py]", "command", "expected a string, got a list"),
        ("env: [A=1]", "env", "expected a mapping, got a list"),
        ("elastic: 3", "elastic", "expected a mapping, got integer 3"),
        (
            "elastic: {heartbeat_timeout: soon}",
            "elastic.heartbeat_timeout",
            "expected a number, got string 'soon'",
        ),
        ("workers: {a: 1}", "workers", "expected a list, got a mapping"),
        ("workers: [gpu1]", "workers[0]", "expected a mapping (one worker), got string 'gpu1'"),
        ("workers: [null]", "workers[0]", "expected a mapping (one worker), got null"),
    ],
)
def test_wrong_types_name_the_key_the_expected_type_and_what_was_found(
    text: str, key: str, message: str
) -> None:
    if not text.startswith("workers"):
        text += "\nworkers: [{host: launcher, nproc: 1}]"
    assert problem_at(error(text), key).message == message


@pytest.mark.parametrize(
    ("snippet", "key", "message"),
    [
        ("nproc: two", "nproc", "expected an integer, got string 'two'"),
        ("nproc: true", "nproc", "expected an integer, got boolean true"),
        ("nproc: 1.5", "nproc", "expected an integer, got float 1.5"),
        ("path: [a]", "path", "expected a string, got a list"),
        ("addr: 10", "addr", "expected a string, got integer 10"),
        ("tunnel: 'yes'", "tunnel", "expected a boolean (true or false), got string 'yes'"),
        ("tunnel: 1", "tunnel", "expected a boolean (true or false), got integer 1"),
        ("ssh: gpu2", "ssh", "expected a mapping, got string 'gpu2'"),
        ("ssh: {port: '22'}", "ssh.port", "expected an integer, got string '22'"),
        ("ssh: {options: StrictHostKeyChecking=no}", "ssh.options", "expected a list, got "),
        ("ssh: {options: [1]}", "ssh.options[0]", "expected a string, got integer 1"),
        ("data_path: 2024-01-01", "data_path", "expected a string, got timestamp 2024-01-01"),
        ("env: {A: 1}", 'env["A"]', "value must be a string, got integer 1"),
    ],
)
def test_wrong_worker_types_name_the_key_path_inside_the_worker(
    snippet: str, key: str, message: str
) -> None:
    base = {"host": "gpu2", "path": "/x", "nproc": "1"}
    base.pop(snippet.split(":")[0], None)  # the snippet replaces that key
    err = worker_error("\n".join(f"{k}: {v}" for k, v in base.items()) + f"\n{snippet}")
    assert problem_at(err, f"workers[0].{key}").message.startswith(message)


def test_null_where_a_string_is_expected_hints_that_tilde_means_null_in_yaml() -> None:
    err = worker_error("host: gpu2\nnproc: 1\npath: ~")
    assert problem_at(err, "workers[0].path").message == (
        "expected a string, got null (to mean '~', quote it: '~')"
    )


@pytest.mark.parametrize("snippet", ["host: ''", "path: '  '", "addr: ''", "ssh: {user: ''}"])
def test_blank_strings_are_rejected(snippet: str) -> None:
    err = worker_error(f"nproc: 1\n{snippet}")
    assert any(p.message == "must not be empty" for p in err.problems), str(err)


@pytest.mark.parametrize(
    "snippet", ["nproc: !!python/object:os.system x", "nproc: !custom 3", "nproc: !!int abc"]
)
def test_yaml_tags_are_never_constructed(snippet: str) -> None:
    err = worker_error(f"host: launcher\n{snippet}")
    assert problem_at(err, "workers[0].nproc").message.startswith("expected an integer, got ")


def test_tagged_mapping_is_not_accepted_as_a_block() -> None:
    err = error("controller: !!python/object:x {host: a}\nworkers: [{host: launcher, nproc: 1}]")
    assert problem_at(err, "controller").message.startswith("expected a mapping, got a value")


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ("controller: {port: 0}", "controller.port", "must be between 1 and 65535, got 0"),
        ("controller: {port: 65536}", "controller.port", "must be between 1 and 65535, got 65536"),
        ("master_port: -5", "master_port", "must be between 1 and 65535, got -5"),
        ("kill_grace: -0.5", "kill_grace", "must be >= 0, got -0.5"),
        ("kill_grace: .inf", "kill_grace", "must be a finite number, got .inf"),
        ("elastic: {formation_timeout: 0}", "elastic.formation_timeout", "must be > 0, got 0"),
        ("elastic: {heartbeat_timeout: -1}", "elastic.heartbeat_timeout", "must be > 0, got -1"),
    ],
)
def test_numbers_out_of_range_are_errors(text: str, key: str, message: str) -> None:
    err = error(f"{text}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert problem_at(err, key).message == message


def test_ports_at_the_edges_of_the_range_are_valid() -> None:
    spec = parse("controller: {port: 1}\nmaster_port: 65535\nworkers: [{host: launcher, nproc: 1}]")
    assert (spec.controller.port, spec.master_port) == (1, 65535)


def test_command_that_cannot_be_split_into_shell_words_is_an_error() -> None:
    err = error("command: python 'train.py\nworkers: [{host: launcher, nproc: 1}]")
    assert problem_at(err, "command").message.startswith("cannot be split into shell words")


# --------------------------------------------------------------------------------------------
# workers: the list itself, host names, CPU vs GPU ranks
# --------------------------------------------------------------------------------------------


def test_workers_is_required() -> None:
    err = error("master_port: 29500\n")
    problem = problem_at(err, "workers")
    assert problem.line == 1
    assert "workers is required" in problem.message


def test_workers_must_not_be_empty() -> None:
    assert problem_at(error("workers: []"), "workers").message == (
        "must list at least one worker (a roster-free window needs "
        "controller.join.discovery: true)")


def test_host_is_required() -> None:
    err = error("workers:\n  - nproc: 1\n")
    problem = problem_at(err, "workers[0].host")
    assert problem.line == 2
    assert problem.message.startswith("host is required")


def test_duplicate_host_is_an_error_naming_both_lines() -> None:
    err = error("""
        workers:
          - host: gpu1
            nproc: 1
            path: /x
          - host: gpu1
            nproc: 1
            path: /x
    """)
    problem = problem_at(err, "workers[1].host")
    assert problem.line == 5
    assert "duplicate host 'gpu1' (also workers[0].host on line 2)" in problem.message
    assert "cluster.yml:5: workers[1].host: duplicate host 'gpu1'" in str(err)


def test_nproc_and_local_devices_together_is_an_error() -> None:
    err = worker_error("host: launcher\nnproc: 2\nlocal_devices: [0]")
    assert problem_at(err, "workers[0]").message == (
        "set either nproc (CPU ranks) or local_devices (GPU ranks), not both"
    )


def test_worker_without_nproc_or_local_devices_is_an_error() -> None:
    err = worker_error("host: launcher")
    problem = problem_at(err, "workers[0]")
    assert "nproc" in problem.message and "local_devices" in problem.message


def test_nproc_must_be_at_least_one() -> None:
    err = worker_error("host: launcher\nnproc: 0")
    assert problem_at(err, "workers[0].nproc").message == "must be between 1 and 1024, got 0"


def test_local_devices_is_a_tuple_of_gpu_indices_in_declared_order() -> None:
    assert worker("host: launcher\nlocal_devices: [3, 0, 2]").local_devices == (3, 0, 2)


def test_local_devices_all_is_kept_as_the_string_all() -> None:
    assert worker("host: launcher\nlocal_devices: all").local_devices == "all"


@pytest.mark.parametrize(
    ("value", "key", "message"),
    [
        ("gpu0", "local_devices", "expected a list of GPU indices or \"all\", got 'gpu0'"),
        ("ALL", "local_devices", "expected a list of GPU indices or \"all\", got 'ALL'"),
        ("3", "local_devices", 'expected a list of GPU indices or "all", got integer 3'),
        ("[]", "local_devices", 'must list at least one GPU index (or be "all")'),
        ("[0, -1]", "local_devices[1]", "must be between 0 and 1023, got -1"),
        ("[0, x]", "local_devices[1]", "expected a GPU index (an integer), got string 'x'"),
        ("[0, true]", "local_devices[1]", "expected a GPU index (an integer), got boolean true"),
        (
            "[1, 2, 1]",
            "local_devices[2]",
            "duplicate GPU index 1 (also workers[0].local_devices[0])",
        ),
    ],
)
def test_bad_local_devices_are_errors_naming_the_value(value: str, key: str, message: str) -> None:
    err = worker_error(f"host: launcher\nlocal_devices: {value}")
    assert problem_at(err, f"workers[0].{key}").message == message


# --------------------------------------------------------------------------------------------
# Local vs remote workers
# --------------------------------------------------------------------------------------------


def test_worker_named_like_this_machine_is_local() -> None:
    assert worker("host: launcher\nnproc: 1", local_hostname="launcher").is_local


def test_worker_named_localhost_is_local() -> None:
    assert worker("host: localhost\nnproc: 1", local_hostname="elsewhere").is_local


def test_worker_with_a_loopback_ssh_target_is_still_remote() -> None:
    w = worker("host: box\nnproc: 1\npath: /x\nssh: {target: 127.0.0.1}")
    assert not w.is_local


def test_local_detection_defaults_to_flodl_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_HOST_NAME", "  gpu7 \n")
    text = yml("""
        workers:
          - {host: gpu7, nproc: 1}
          - {host: gpu8, nproc: 1, path: /x}
    """)
    spec = parse_cluster(text, folder=FOLDER)
    assert [w.is_local for w in spec.workers] == [True, False]


def test_this_host_name_prefers_flodl_host_name_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_HOST_NAME", " node-3 ")
    monkeypatch.setattr("socket.gethostname", lambda: "ubuntu")
    assert this_host_name() == "node-3"


@pytest.mark.parametrize("value", [None, "", "   "])
def test_this_host_name_falls_back_to_the_hostname(
    monkeypatch: pytest.MonkeyPatch, value: Optional[str]
) -> None:
    if value is None:
        monkeypatch.delenv("FLODL_HOST_NAME", raising=False)
    else:
        monkeypatch.setenv("FLODL_HOST_NAME", value)
    monkeypatch.setattr("socket.gethostname", lambda: "ubuntu")
    assert this_host_name() == "ubuntu"


def test_tunnel_on_a_local_worker_is_an_error() -> None:
    err = worker_error("host: launcher\nnproc: 1\ntunnel: true")
    problem = problem_at(err, "workers[0].tunnel")
    assert problem.line == 4
    assert "only for remote workers" in problem.message


def test_tunnel_on_a_remote_worker_is_allowed() -> None:
    assert worker("host: gpu2\nnproc: 1\npath: /x\ntunnel: true").tunnel


def test_ssh_block_on_a_local_worker_is_allowed() -> None:
    w = worker("host: launcher\nnproc: 1\nssh: {target: 10.0.0.1, user: me}")
    assert w.is_local
    assert w.addr == "127.0.0.1"  # the ssh target does not leak into a local worker's address


def test_ssh_block_on_a_local_worker_is_still_type_checked() -> None:
    # The same file launched from another machine makes this worker remote.
    err = worker_error("host: launcher\nnproc: 1\nssh: {port: ssh}")
    assert problem_at(err, "workers[0].ssh.port")


# --------------------------------------------------------------------------------------------
# path, data_path, addr, identity_file
# --------------------------------------------------------------------------------------------


def test_local_worker_path_defaults_to_the_cluster_file_folder() -> None:
    assert worker("host: launcher\nnproc: 1").path == FOLDER


def test_remote_worker_without_path_is_an_error() -> None:
    err = worker_error("host: gpu2\nnproc: 1")
    problem = problem_at(err, "workers[0].path")
    assert problem.line == 2
    assert problem.message == (
        "path is required for a remote worker (its working directory on that host)"
    )


@pytest.mark.parametrize(
    ("host", "raw", "resolved"),
    [
        ("launcher", "run", f"{FOLDER}/run"),
        ("launcher", "../other/./run/", "/srv/other/run"),
        ("launcher", "/abs//job/", "/abs/job"),
        ("gpu2", "run", f"{FOLDER}/run"),
        ("gpu2", "/abs/job", "/abs/job"),
    ],
)
def test_relative_paths_resolve_against_the_cluster_file_folder(
    host: str, raw: str, resolved: str
) -> None:
    w = worker(f"host: {host}\nnproc: 1\npath: {raw}\ndata_path: {raw}")
    assert (w.path, w.data_path) == (resolved, resolved)


def test_tilde_is_expanded_for_a_local_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/me")
    w = worker("host: launcher\nnproc: 1\npath: ~/job\ndata_path: ~/data")
    assert (w.path, w.data_path) == ("/home/me/job", "/home/me/data")


def test_tilde_is_kept_for_a_remote_worker_whose_home_we_cannot_know() -> None:
    w = worker("host: gpu2\nnproc: 1\npath: ~/job\ndata_path: '~'")
    assert (w.path, w.data_path) == ("~/job", "~")


def test_load_cluster_resolves_against_the_folder_of_the_file_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "c.yml").write_text("workers: [{host: launcher, nproc: 1, path: run}]")
    monkeypatch.chdir(tmp_path)
    spec = load_cluster("conf/c.yml", local_hostname=LOCAL)
    assert spec.file == "conf/c.yml"
    assert spec.folder == str(tmp_path / "conf")
    assert spec.workers[0].path == str(tmp_path / "conf" / "run")


def test_parse_cluster_folder_defaults_to_the_folder_of_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = parse_cluster("workers: [{host: x, nproc: 1}]", file="a/c.yml", local_hostname="x")
    assert spec.folder == str(tmp_path / "a")


def test_local_worker_addr_defaults_to_the_controller_host() -> None:
    spec = parse("controller: {host: 10.0.0.1}\nworkers: [{host: launcher, nproc: 1}]")
    assert spec.workers[0].addr == "10.0.0.1"


def test_remote_worker_addr_defaults_to_the_ssh_target() -> None:
    assert worker("host: gpu2\nnproc: 1\npath: /x\nssh: {target: 10.0.0.2}").addr == "10.0.0.2"


def test_remote_worker_addr_drops_a_user_prefix_from_the_ssh_target() -> None:
    assert worker("host: gpu2\nnproc: 1\npath: /x\nssh: {target: me@10.0.0.2}").addr == "10.0.0.2"


def test_remote_worker_addr_defaults_to_the_host_without_ssh_target() -> None:
    assert worker("host: gpu2\nnproc: 1\npath: /x").addr == "gpu2"


def test_explicit_addr_wins() -> None:
    assert worker("host: gpu2\nnproc: 1\npath: /x\naddr: 192.168.1.2").addr == "192.168.1.2"
    assert worker("host: launcher\nnproc: 1\naddr: 192.168.1.1").addr == "192.168.1.1"


def test_identity_file_expands_tilde_and_resolves_relative_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOME", "/home/me")
    home = worker("host: gpu2\nnproc: 1\npath: /x\nssh: {identity_file: ~/.ssh/id}")
    relative = worker("host: gpu2\nnproc: 1\npath: /x\nssh: {identity_file: keys/id}")
    assert home.ssh.identity_file == "/home/me/.ssh/id"
    assert relative.ssh.identity_file == f"{FOLDER}/keys/id"


def test_ssh_options_are_kept_raw_in_declared_order() -> None:
    w = worker("host: gpu2\nnproc: 1\npath: /x\nssh: {options: [B=2, A=1, ProxyJump=a@b:22]}")
    assert w.ssh.options == ("B=2", "A=1", "ProxyJump=a@b:22")


def test_ssh_option_may_have_spaces_around_the_equals_sign() -> None:
    w = worker("host: gpu2\nnproc: 1\npath: /x\nssh: {options: ['BatchMode = yes']}")
    assert w.ssh.options == ("BatchMode = yes",)


@pytest.mark.parametrize("option", ["StrictHostKeyChecking", "=no", "-oBatchMode=yes", "A B=1"])
def test_ssh_option_must_be_key_equals_value(option: str) -> None:
    err = worker_error(f"host: gpu2\nnproc: 1\npath: /x\nssh: {{options: [A=1, '{option}']}}")
    assert problem_at(err, "workers[0].ssh.options[1]").message.startswith("expected 'Key=Value'")


@pytest.mark.parametrize("port", ["0", "65536"])
def test_ssh_port_must_be_a_tcp_port(port: str) -> None:
    err = worker_error(f"host: gpu2\nnproc: 1\npath: /x\nssh: {{port: {port}}}")
    assert problem_at(err, "workers[0].ssh.port").message.startswith("must be between 1 and")


# --------------------------------------------------------------------------------------------
# env
# --------------------------------------------------------------------------------------------


def test_invalid_worker_env_name_names_file_line_and_key_path() -> None:
    err = error("""
        workers:
          - host: launcher
            nproc: 1
          - host: gpu2
            nproc: 1
            path: /x
            env: {"A B": x}
    """)
    assert 'cluster.yml:7: workers[1].env["A B"]: not a valid environment variable name' in str(err)


def test_invalid_top_level_env_name_is_an_error() -> None:
    err = error('env:\n  "1X": a\nworkers: [{host: launcher, nproc: 1}]')
    assert str(problem_at(err, 'env["1X"]')) == (
        'cluster.yml:2: env["1X"]: not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)'
    )


@pytest.mark.parametrize("name", sorted(RESERVED_ENV_KEYS) + ["FLODL_INTERNAL_ANYTHING"])
def test_reserved_env_names_are_errors_pointing_to_local_devices(name: str) -> None:
    err = error(f"env: {{{name}: x}}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert problem_at(err, f'env["{name}"]').message == (
        "is reserved (set by the launcher for each rank); GPU pinning belongs in local_devices"
    )


def test_reserved_env_names_are_errors_in_worker_env_too() -> None:
    err = worker_error("host: launcher\nnproc: 1\nenv: {CUDA_VISIBLE_DEVICES: '0'}")
    assert "is reserved" in problem_at(err, 'workers[0].env["CUDA_VISIBLE_DEVICES"]').message


@pytest.mark.parametrize(
    "name", ["FLODL_VERBOSITY", "LD_LIBRARY_PATH", "LD_PRELOAD", "NCCL_DEBUG", "NCCL_IB_HCA"]
)
def test_launcher_adjacent_env_names_are_allowed_on_purpose(name: str) -> None:
    assert not is_reserved_env_key(name)
    spec = parse(f"env: {{{name}: v}}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert spec.env == {name: "v"}


def test_reserved_names_are_case_sensitive_like_the_environment() -> None:
    assert is_reserved_env_key("RANK")
    assert is_reserved_env_key("FLODL_INTERNAL_")
    assert not is_reserved_env_key("rank")
    assert not is_reserved_env_key("FLODL_INTERNALS")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("8", 'value must be a string, got integer 8 (quote it in YAML: "8")'),
        ("1.5", 'value must be a string, got float 1.5 (quote it in YAML: "1.5")'),
        ("true", 'value must be a string, got boolean true (quote it in YAML: "true")'),
        ("null", 'value must be a string, got null (write "" for an empty value)'),
        ("", 'value must be a string, got null (write "" for an empty value)'),
        ("[a]", "value must be a string, got a list"),
    ],
)
def test_env_values_must_be_strings(value: str, message: str) -> None:
    err = error(f"env:\n  X: {value}\nworkers: [{{host: launcher, nproc: 1}}]")
    problem = problem_at(err, 'env["X"]')
    assert (problem.line, problem.message) == (2, message)


def test_env_value_with_a_nul_character_is_an_error() -> None:
    err = error('env: {X: "a\\0b"}\nworkers: [{host: launcher, nproc: 1}]')
    assert "NUL" in problem_at(err, 'env["X"]').message


def test_env_names_are_taken_as_written_not_as_yaml_booleans() -> None:
    spec = parse("env: {NO: a, ON: b, Y: c}\nworkers: [{host: launcher, nproc: 1}]")
    assert spec.env == {"NO": "a", "ON": "b", "Y": "c"}


def test_empty_env_value_is_allowed() -> None:
    assert parse('env: {X: ""}\nworkers: [{host: launcher, nproc: 1}]').env == {"X": ""}


def test_env_name_regex_is_the_posix_portable_one() -> None:
    assert ENV_NAME_RE.fullmatch("_a1")
    assert not ENV_NAME_RE.fullmatch("1a")
    assert not ENV_NAME_RE.fullmatch("A-B")
    assert not ENV_NAME_RE.fullmatch("")


def _file_with_env(env: dict[str, str]) -> str:
    """A file whose top-level env and single worker env are both ``env``, dumped by PyYAML so
    that any string (quotes, newlines, unicode) is written the way a careful user would."""
    return yaml.safe_dump({"env": env, "workers": [{"host": LOCAL, "nproc": 1, "env": env}]})


_valid_names = st.from_regex(ENV_NAME_RE, fullmatch=True).filter(
    lambda name: not is_reserved_env_key(name) and len(name) <= ENV_NAME_MAX
)
_values_without_nul = st.text().filter(lambda value: "\0" not in value)


@settings(max_examples=60, deadline=None)
@given(env=st.dictionaries(_valid_names, _values_without_nul, max_size=4))
def test_any_valid_non_reserved_name_and_string_value_round_trips_exactly(
    env: dict[str, str],
) -> None:
    spec = parse_cluster(_file_with_env(env), local_hostname=LOCAL, folder=FOLDER)
    assert spec.env == env
    assert spec.workers[0].env == env


@settings(max_examples=60, deadline=None)
@given(name=st.text(max_size=40).filter(lambda name: not ENV_NAME_RE.fullmatch(name)))
def test_any_name_outside_the_env_regex_is_rejected(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster(_file_with_env({name: "x"}), local_hostname=LOCAL, folder=FOLDER)
    quoted = json.dumps(name, ensure_ascii=False)
    for key in (f"env[{quoted}]", f"workers[0].env[{quoted}]"):
        assert problem_at(info.value, key).message.startswith(
            "not a valid environment variable name"
        )


# --------------------------------------------------------------------------------------------
# elastic.max_failure
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (None, None),
        (0, 0),
        (3, 3),
        ("3", 3),
        ("25%", 0.25),
        ("0%", 0.0),
        ("100%", 1.0),
        ("12.5%", 0.125),
        (" 50% ", 0.5),
    ],
)
def test_parse_max_failure_accepts_counts_and_percentages(value: object, parsed: object) -> None:
    result = parse_max_failure(value)
    assert result == parsed
    assert type(result) is type(parsed)  # 1.0 means "all of them", 1 means "one worker"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "must be >= 0, got -1"),
        ("abc", "expected a count like 3 or a percentage like '25%', got 'abc'"),
        ("-5%", "got '-5%'"),
        ("150%", "a percentage must be between 0% and 100%, got '150%'"),
        ("100.5%", "between 0% and 100%"),
        (True, "got True"),
        (0.25, "write a fraction as a percentage"),
        ([1], "got list"),
    ],
)
def test_parse_max_failure_rejects_everything_else_clearly(value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_max_failure(value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("written", "parsed"), [("2", 2), ("25%", 0.25), ("'3'", 3), ("null", None), ("", None)]
)
def test_elastic_max_failure_in_the_file(written: str, parsed: object) -> None:
    spec = parse(f"elastic:\n  max_failure: {written}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert spec.elastic.max_failure == parsed


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("-1", "must be >= 0, got -1"),
        ("lots", "expected a count like 3 or a percentage like '25%', got 'lots'"),
        ("true", "expected a count like 3 or a percentage like '25%', got boolean true"),
        ("0.25", "expected a count like 3 or a percentage like '25%', got float 0.25"),
        ("200%", "a percentage must be between 0% and 100%, got '200%'"),
    ],
)
def test_bad_elastic_max_failure_is_reported_at_its_line(written: str, message: str) -> None:
    err = error(f"elastic:\n  max_failure: {written}\nworkers: [{{host: launcher, nproc: 1}}]")
    problem = problem_at(err, "elastic.max_failure")
    assert (problem.line, problem.message) == (2, message)


# --------------------------------------------------------------------------------------------
# Bounds: a file cannot make us block, recurse or allocate without limit
# --------------------------------------------------------------------------------------------
#
# Each case is refused with one ConfigError (exit 2 at the CLI) whose message names the key
# and line, and returns quickly: the budget is generous for a shared CI machine but far
# below what the unbounded versions took (minutes, or gigabytes).

FAST = 3.0  # seconds


@contextlib.contextmanager
def returns_fast(seconds: float = FAST) -> Iterator[None]:
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.2f}s"


def refused(text: str, **kwargs: Any) -> ConfigError:
    """Parse ``text`` as is (no dedent: these files are generated) and return the error."""
    kwargs.setdefault("folder", FOLDER)
    kwargs.setdefault("local_hostname", LOCAL)
    with returns_fast(), pytest.raises(ConfigError) as info:
        parse_cluster(text, **kwargs)
    return info.value


def load_refused(path: Union[str, Path]) -> ConfigError:
    with returns_fast(), pytest.raises(ConfigError) as info:
        load_cluster(path, local_hostname=LOCAL)
    return info.value


def _workers(count: int, body: str = "nproc: 1") -> str:
    return "workers:\n" + "".join(f"  - {{host: h{i}, path: /x, {body}}}\n" for i in range(count))


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_as_the_cluster_file_is_refused_without_reading_it() -> None:
    (problem,) = load_refused("/dev/zero").problems
    assert str(problem) == (
        "/dev/zero: not a regular file (a character device); a cluster file must be a regular file"
    )


def test_a_fifo_as_the_cluster_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "cluster.yml"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(outcome, lambda: load_cluster(fifo)))
    thread.start()
    thread.join(FAST)
    if thread.is_alive():  # blocked in open(): give it a writer so the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
        pytest.fail("load_cluster blocked on a FIFO")
    (error,) = outcome
    assert isinstance(error, ConfigError)
    assert error.problems[0].message.startswith("not a regular file (a FIFO)")


def _capture(outcome: list[BaseException], call: Callable[[], object]) -> None:
    try:
        call()
    except BaseException as exc:
        outcome.append(exc)


def test_a_directory_as_the_cluster_file_is_refused(tmp_path: Path) -> None:
    (problem,) = load_refused(tmp_path).problems
    assert problem.message.startswith("not a regular file (a directory)")


def test_a_file_that_is_not_utf_8_is_refused_with_the_line(tmp_path: Path) -> None:
    file = tmp_path / "cluster.yml"
    file.write_bytes(b"workers:\n  - host: caf\xe9\n")
    (problem,) = load_refused(file).problems
    assert (problem.line, problem.message) == (2, "not valid UTF-8 (invalid continuation byte)")


def test_a_cluster_file_over_1_mib_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    file = tmp_path / "cluster.yml"
    file.write_text("workers: [{host: launcher, nproc: 1}]\n" + "#" * FILE_MAX_BYTES)
    (problem,) = load_refused(file).problems
    assert problem.message.startswith(f"file is {file.stat().st_size} bytes; a cluster file")
    assert "at most 1048576 bytes (1 MiB)" in problem.message


def test_a_cluster_file_of_exactly_1_mib_is_read(tmp_path: Path) -> None:
    head = "workers: [{host: launcher, nproc: 1}]\n"
    file = tmp_path / "cluster.yml"
    file.write_text(head + "#" * (FILE_MAX_BYTES - len(head) - 1) + "\n")
    assert file.stat().st_size == FILE_MAX_BYTES
    with returns_fast():
        assert load_cluster(file, local_hostname=LOCAL).workers[0].nproc == 1


def test_text_over_1_mib_is_refused_by_parse_cluster_too() -> None:
    (problem,) = refused("workers: []\n" + "#" * FILE_MAX_BYTES).problems
    assert "a cluster file may have at most 1048576 bytes" in problem.message


def test_a_5000_deep_file_is_refused_without_a_recursion_error(tmp_path: Path) -> None:
    file = tmp_path / "cluster.yml"
    file.write_text("[" * 5000 + "]" * 5000 + "\n")
    (problem,) = load_refused(file).problems
    assert problem.line == 1
    assert problem.message == "nested more than 32 levels deep (lists and mappings)"


def test_deep_nesting_names_the_key_path_and_line_where_it_goes_too_deep() -> None:
    text = "workers:\n  - host: launcher\n    nproc: 1\n    env: " + "{a: " * 100 + "x"
    text += "}" * 100 + "\n"
    (problem,) = refused(text).problems
    assert problem.line == 4
    assert problem.key == "workers[0].env" + ".a" * (DEPTH_MAX - 3)


def test_nesting_up_to_the_limit_is_only_a_schema_problem() -> None:
    # top-level mapping, workers, one worker: 3 levels before the value of nproc
    deep = "[" * (DEPTH_MAX - 3) + "]" * (DEPTH_MAX - 3)
    err = refused(f"x-deep: {deep}\nworkers: [{{host: launcher, nproc: {deep}}}]\n")
    assert problem_at(err, "workers[0].nproc").message == "expected an integer, got a list"


def test_nproc_of_a_billion_is_refused_before_any_rank_exists() -> None:
    err = refused("workers:\n  - host: launcher\n    nproc: 1000000000\n")
    problem = problem_at(err, "workers[0].nproc")
    assert str(problem) == (
        "cluster.yml:3: workers[0].nproc: must be between 1 and 1024, got 1000000000"
    )


def test_more_than_4096_workers_are_refused_even_when_written_as_aliases() -> None:
    text = "x-w: &w {host: a, nproc: 1}\nworkers: [" + "*w, " * (WORKERS_MAX + 1) + "]\n"
    err = refused(text)
    assert str(problem_at(err, "workers")) == (
        "cluster.yml:2: workers: lists 4097 workers; at most 4096 are allowed"
    )
    assert len(err.problems) == 1  # refused as a whole, not as 4097 duplicate hosts


def test_more_than_65536_ranks_in_total_are_refused() -> None:
    err = refused(_workers(65, "nproc: 1024"), local_hostname="elsewhere")
    assert str(problem_at(err, "workers")) == (
        "cluster.yml:2: workers: the workers have 66560 ranks in total; at most 65536 are allowed"
    )


def test_the_limits_fit_a_1000_host_cluster_with_room_to_spare(tmp_path: Path) -> None:
    lines = ["controller: {host: 10.0.0.1, port: 7000}", "command: python3 train.py",
             "env: {NCCL_DEBUG: WARN, NCCL_IB_HCA: mlx5}", "workers:"]
    for i in range(1000):
        lines += [
            f"  - host: gpu-{i:04d}.cluster.example.com",
            "    local_devices: [0, 1, 2, 3, 4, 5, 6, 7]",
            f"    path: /srv/jobs/run-{i:04d}",
            f"    addr: 10.{i // 250}.{i % 250}.1",
            "    nccl_socket_ifname: ib0",
            "    env: {OMP_NUM_THREADS: '8'}",
            "    ssh: {user: trainer, port: 2222, options: [ServerAliveInterval=5]}",
        ]
    file = tmp_path / "cluster.yml"
    file.write_text("\n".join(lines) + "\n")
    assert file.stat().st_size < FILE_MAX_BYTES / 2
    with returns_fast(10.0):
        spec = load_cluster(file, local_hostname="ctl")
    assert len(spec.workers) == 1000
    assert sum(len(w.local_devices or ()) for w in spec.workers) == 8000


def test_the_largest_allowed_job_is_accepted() -> None:
    text = "x-w: &w {nproc: 16, path: /x}\nworkers:\n" + "".join(
        f"  - {{<<: *w, host: h{i}}}\n" for i in range(WORKERS_MAX)
    )
    with returns_fast(10.0):
        spec = parse(text, local_hostname="elsewhere")
    assert sum(w.nproc or 0 for w in spec.workers) == RANKS_MAX


def test_local_devices_listing_more_than_1024_gpus_is_refused() -> None:
    devices = ", ".join(str(i) for i in range(RANKS_PER_WORKER_MAX + 1))
    err = refused(f"workers:\n  - host: launcher\n    local_devices: [{devices}]\n")
    assert problem_at(err, "workers[0].local_devices").message == (
        "lists 1025 GPUs; at most 1024 ranks per worker"
    )


def test_a_20_mb_single_word_command_is_refused_by_the_file_size(tmp_path: Path) -> None:
    file = tmp_path / "cluster.yml"
    file.write_text("command: " + "a" * (20 << 20) + "\nworkers: [{host: launcher, nproc: 1}]\n")
    (problem,) = load_refused(file).problems
    assert "a cluster file may have at most 1048576 bytes" in problem.message


def test_a_command_over_256_kib_is_refused_naming_the_key() -> None:
    command = "a " * (COMMAND_MAX_BYTES // 2) + "b"
    err = refused(f"command: {command}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert str(problem_at(err, "command")) == (
        "cluster.yml:1: command: is 262145 bytes long; a command has at most 262144 (256 KiB)"
    )


def test_a_200_kb_argv_given_as_many_words_is_accepted() -> None:
    words = [f"--arg{i}=" + "v" * 990 for i in range(200)]
    spec = parse(f"command: {' '.join(words)}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert spec.command is not None and shlex.split(spec.command) == words


def test_a_command_word_longer_than_max_arg_strlen_is_refused() -> None:
    word = "w" * (ARG_STRLEN_MAX + 1)
    err = refused(f"command: python3 {word}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert problem_at(err, "command").message == (
        "word 2 is 131072 bytes long; Linux limits one program argument to 131071 bytes "
        "(MAX_ARG_STRLEN)"
    )


def test_a_command_word_of_exactly_max_arg_strlen_is_accepted() -> None:
    word = "w" * ARG_STRLEN_MAX
    with returns_fast():
        spec = parse(f"command: python3 {word}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert spec.command == f"python3 {word}"


def test_a_command_with_a_nul_character_is_refused() -> None:
    err = refused('command: "python3 a\\0b"\nworkers: [{host: launcher, nproc: 1}]')
    assert "NUL" in problem_at(err, "command").message


def test_an_env_name_over_256_characters_is_refused() -> None:
    name = "N" * (ENV_NAME_MAX + 1)
    err = refused(f"env: {{{name}: x}}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert problem_at(err, f'env["{name[:57]}..."]').message == (
        "name is 257 characters long; at most 256"
    )


def test_an_env_string_longer_than_max_arg_strlen_is_refused() -> None:
    value = "v" * (ARG_STRLEN_MAX - len("NAME="))
    spec = parse(f"env: {{NAME: {value}}}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert len(spec.env["NAME"]) == ARG_STRLEN_MAX - 5
    err = refused(f"env:\n  NAME: {value}v\nworkers: [{{host: launcher, nproc: 1}}]")
    assert str(problem_at(err, 'env["NAME"]')) == (
        'cluster.yml:2: env["NAME"]: NAME=value is 131072 bytes long; Linux limits one '
        "environment string to 131071 bytes (MAX_ARG_STRLEN)"
    )


def test_more_than_256_env_variables_in_one_mapping_are_refused() -> None:
    env = ", ".join(f"V{i}: x" for i in range(ENV_VARS_MAX + 1))
    err = refused(f"env: {{{env}}}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert problem_at(err, "env").message == "has 257 entries; at most 256"


def test_the_cluster_env_and_a_worker_env_together_are_held_to_256_variables() -> None:
    half = ENV_VARS_MAX // 2 + 1
    top = ", ".join(f"A{i}: x" for i in range(half))
    own = ", ".join(f"B{i}: x" for i in range(half))
    worker_env = f"  - host: launcher\n    nproc: 1\n    env: {{{own}}}\n"
    err = refused(f"env: {{{top}}}\nworkers:\n{worker_env}")
    assert str(problem_at(err, "workers[0].env")) == (
        "cluster.yml:5: workers[0].env: a rank gets 258 environment variables from the file "
        "(the cluster env and this worker's env together); at most 256 are allowed"
    )


def test_env_bytes_repeated_through_aliases_are_held_to_1_mib_per_rank() -> None:
    value = "v" * 100_000
    env = ", ".join(f"V{i}: *big" for i in range(11))
    err = refused(f"x-big: &big {value}\nenv: {{{env}}}\nworkers: [{{host: launcher, nproc: 1}}]")
    problem = problem_at(err, "env")
    assert problem.line == 2
    # V0=... to V9=... are 100003 bytes each, V10=... 100004
    assert problem.message.startswith("a rank gets 1100034 bytes of NAME=value strings")


def test_more_than_64_ssh_options_are_refused() -> None:
    options = ", ".join(["BatchMode=yes"] * (SSH_OPTIONS_MAX + 1))
    err = worker_error(f"host: gpu2\nnproc: 1\npath: /x\nssh: {{options: [{options}]}}")
    assert problem_at(err, "workers[0].ssh.options").message == (
        "lists 65 options; at most 64 are allowed"
    )


def test_a_path_longer_than_path_max_is_refused() -> None:
    err = worker_error(f"host: gpu2\nnproc: 1\npath: /{'p' * PATH_MAX_BYTES}")
    assert problem_at(err, "workers[0].path").message == (
        "is 4097 bytes long; a path has at most 4096 (PATH_MAX)"
    )


@pytest.mark.parametrize("key", ["path", "data_path", "ssh.identity_file"])
@pytest.mark.parametrize(("written", "found"), [("a\\0b", "NUL"), ("a\\nb", "line break")])
def test_paths_must_not_contain_nul_or_a_newline(key: str, written: str, found: str) -> None:
    value = f'"/x/{written}"'
    fields = {"path": "/x", key: value}
    if key.startswith("ssh."):
        fields = {"path": "/x", "ssh": f"{{identity_file: {value}}}"}
    err = worker_error("host: gpu2\nnproc: 1\n" + "\n".join(f"{k}: {v}" for k, v in fields.items()))
    assert found in problem_at(err, f"workers[0].{key}").message


@pytest.mark.parametrize(
    ("key", "snippet"),
    [
        ("kill_grace", "kill_grace: 1e9"),
        ("elastic.formation_timeout", "elastic: {formation_timeout: 2000000}"),
        ("elastic.heartbeat_timeout", "elastic: {heartbeat_timeout: 1.0e+7}"),
    ],
)
def test_durations_are_at_most_a_million_seconds(key: str, snippet: str) -> None:
    err = refused(f"{snippet}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert problem_at(err, key).message.startswith("must be at most 1e+06, got ")


def test_a_yaml_1_1_sexagesimal_number_of_a_megabyte_is_not_constructed() -> None:
    err = refused("workers: [{host: launcher, nproc: " + "1:" * 300_000 + "1}]")
    assert problem_at(err, "workers[0].nproc").message == (
        "is a number of 600001 characters; at most 100 are read"
    )


def test_a_huge_hex_number_is_refused_before_it_is_printed() -> None:
    # str() of an int over 4300 digits raises ValueError in Python >= 3.11.
    err = refused("workers: [{host: launcher, nproc: 0x" + "f" * 5000 + "}]")
    assert "at most 100 are read" in problem_at(err, "workers[0].nproc").message


def test_values_quoted_in_messages_are_shortened() -> None:
    err = refused(f"workers: [{{host: launcher, nproc: {'z' * 100_000}}}]")
    message = problem_at(err, "workers[0].nproc").message
    assert message == f"expected an integer, got string {'z' * 60!r}... (100000 characters)"


def test_a_broken_mapping_repeated_through_aliases_stops_after_100_problems() -> None:
    keys = ", ".join(f"k{i}: 1" for i in range(5000))
    err = refused(f"x-w: &w {{{keys}}}\nworkers: [" + "*w, " * 4000 + "]\n")
    assert len(err.problems) == PROBLEMS_MAX + 1
    assert str(err.problems[-1]) == (
        "cluster.yml: stopped after 100 problems; fix these and check again"
    )


def test_merges_cannot_multiply_into_unbounded_work() -> None:
    keys = ", ".join(f"k{i}: 1" for i in range(2000))
    sources = ", ".join(["*big"] * 2000)
    text = f"x-big: &big {{{keys}}}\nx-many: &many {{<<: [{sources}]}}\nworkers:\n"
    text += "".join(f"  - {{<<: [*many, *many], host: h{i}, nproc: 1}}\n" for i in range(1000))
    err = refused(text)
    assert any("merge keys copy more than 2097152 entries" in p.message for p in err.problems)


def test_a_lone_surrogate_is_refused_as_invalid_unicode() -> None:
    err = refused("workers: [{host: launcher, nproc: 1, path: '/x\udc80'}]")
    (problem,) = err.problems
    assert problem.message == "not valid Unicode (a lone surrogate U+DC80)"


def test_the_pure_python_parser_is_bounded_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(yamlread, "_Loader", yamlread._PyLoader)
    (problem,) = refused("[" * 5000 + "]" * 5000).problems
    assert problem.message == "nested more than 32 levels deep (lists and mappings)"
    assert parse("x-d: &d {nproc: 2}\nworkers: [{<<: *d, host: launcher}]").workers[0].nproc == 2
    assert problem_at(refused('workers: [{host: "\\ud800", nproc: 1}]'), "workers[0].host")


# --------------------------------------------------------------------------------------------
# Host names, addresses and users
# --------------------------------------------------------------------------------------------

GOOD_HOSTS = [
    "gpu1",
    "gpu-a",
    "node_7",
    "n1.cluster.example.com",
    "n1.cluster.example.com.",
    "10.0.0.1",
    "::1",
    "2001:db8::17",
    "fe80::1%eth0",
    "a" * 63 + "." + "b" * 63,
]
BAD_HOSTS = [
    ("a;b", "contains ';'"),
    ("a b", "contains a space"),
    ("a\nb", "contains a newline"),
    ("h1 pgid=22602 start=1677925", "contains a space"),
    ("a=b", "contains '='"),
    ("a/b", "contains '/'"),
    ("gpü", "contains 'ü'"),
    ("-oProxyCommand", "starts or ends with '-'"),
    ("a-.b", "starts or ends with '-'"),
    ("a..b", "has an empty label"),
    (".a", "has an empty label"),
    ("a" * 64, "has a label of 64 characters; DNS allows 63"),
    ("a." * 127, "is 254 characters long; a host name has at most 253"),
    ("999.1.1.1", "is not a valid IPv4 address"),
    ("10.1", "is not a valid IPv4 address"),
    ("010.0.0.1", "is not a valid IPv4 address"),
    ("0x7f.1", "is not a valid IPv4 address"),
    ("[::1]", "without brackets"),
    ("::g", "is not a valid IPv6 address"),
    ("fe80::1%a b", "invalid zone"),
]


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_dns_names_and_ip_addresses_are_valid_host_names(host: str) -> None:
    assert host_name_problem(host) is None
    w = worker(f"host: {json.dumps(host)}\nnproc: 1\npath: /x\naddr: {json.dumps(host)}")
    assert (w.host, w.addr) == (host, host)


@pytest.mark.parametrize(("host", "message"), BAD_HOSTS)
def test_host_names_outside_the_grammar_are_refused_by_the_config_check(
    host: str, message: str
) -> None:
    err = worker_error(f"host: {json.dumps(host)}\nnproc: 1\npath: /x")
    problem = problem_at(err, "workers[0].host")
    assert problem.line == 2 and message in problem.message
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("snippet", "key"),
    [
        ("addr: 'a b'", "workers[0].addr"),
        ("ssh: {target: 'a;b'}", "workers[0].ssh.target"),
        ("ssh: {target: 'me@a b'}", "workers[0].ssh.target"),
        ("ssh: {target: 'm e@host'}", "workers[0].ssh.target"),
        ("ssh: {user: '-oops'}", "workers[0].ssh.user"),
        ("ssh: {options: ['HostName=a b']}", "workers[0].ssh.options[0]"),
        ("ssh: {options: ['User=a;b']}", "workers[0].ssh.options[0]"),
        ("ssh: {options: ['ProxyJump=ok,bad host']}", "workers[0].ssh.options[0]"),
    ],
)
def test_every_key_naming_a_host_or_user_follows_the_grammar(snippet: str, key: str) -> None:
    err = worker_error(f"host: gpu2\nnproc: 1\npath: /x\n{snippet}")
    assert problem_at(err, key).line == 5


def test_controller_host_follows_the_grammar() -> None:
    err = refused("controller: {host: 'ctl; rm -rf /'}\nworkers: [{host: launcher, nproc: 1}]")
    assert problem_at(err, "controller.host").message.startswith("contains ';'")


def test_a_wildcard_controller_host_is_refused_when_a_remote_worker_must_dial_it() -> None:
    err = refused("controller: {host: 0.0.0.0}\n"
                  "workers: [{host: gpu-a.example.invalid, nproc: 1, path: /srv}]")
    assert problem_at(err, "controller").message.startswith("host '0.0.0.0' is a wildcard")
    # Only local workers: nothing dials it, so binding every address is allowed.
    parse("controller: {host: 0.0.0.0}\nworkers: [{host: launcher, nproc: 1}]")


def test_ssh_target_may_name_a_user() -> None:
    w = worker("host: gpu2\nnproc: 1\npath: /x\nssh: {target: deploy.bot@10.0.0.2}")
    assert (w.ssh.target, w.addr) == ("deploy.bot@10.0.0.2", "10.0.0.2")


# --------------------------------------------------------------------------------------------
# ssh.options: one line each, and values the launcher can use as meant
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ('"User=me\\nProxyCommand nc %h %p"', "contains a newline"),
        ('"ServerAliveInterval=5\\rProxyCommand x"', "contains a carriage return"),
        ('"BatchMode=\\tyes"', "contains a tab"),
        ('"User=me\\u2028ProxyCommand x"', "U+2028"),
        ('"User=me\\x85ProxyCommand x"', "U+0085"),
        ('"User=a\\0"', "U+0000"),
    ],
)
def test_an_ssh_option_with_a_second_line_is_refused(written: str, message: str) -> None:
    err = worker_error(f"host: gpu2\nnproc: 1\npath: /x\nssh:\n  options:\n    - {written}")
    problem = problem_at(err, "workers[0].ssh.options[0]")
    assert problem.line == 7
    assert message in problem.message and "single line" in problem.message


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("Port=0", "Port='0': must be a port number between 1 and 65535"),
        ("Port=65536", "Port='65536': must be a port number between 1 and 65535"),
        ("Port=22x", "Port='22x': must be a port number between 1 and 65535"),
        ("port=+22", "port='+22': must be a port number between 1 and 65535"),
        ("ProxyJump=jump:0", "ProxyJump='jump:0': jump host 'jump:0': must be a port number"),
        ("ConnectTimeout=nan", "ConnectTimeout='nan': must be a number of seconds"),
        ("ServerAliveInterval=1e9", "ServerAliveInterval='1e9': must be a number of seconds"),
        ("ServerAliveCountMax=-1", "ServerAliveCountMax='-1': must be a whole number >= 0"),
        ("StrictHostKeyChecking=maybe", "StrictHostKeyChecking='maybe': must be one of yes"),
        ("User=", "User='': has no value"),
    ],
)
def test_ssh_option_values_that_would_mean_something_else_are_refused(
    option: str, message: str
) -> None:
    err = worker_error(f"host: gpu2\nnproc: 1\npath: /x\nssh: {{options: ['{option}']}}")
    problem = problem_at(err, "workers[0].ssh.options[0]")
    assert problem.line == 5 and problem.message.startswith(message)


@pytest.mark.parametrize(
    "option",
    ["Port=1", "Port=65535", "ProxyJump=none", "ProxyJump=a@b:22,c", "ConnectTimeout=2.5",
     "StrictHostKeyChecking=OFF", "BatchMode=no", "HostName=10.0.0.7", "IdentityFile=~/.ssh/k"],
)
def test_ssh_option_values_in_the_grammar_are_kept_as_written(option: str) -> None:
    w = worker(f"host: gpu2\nnproc: 1\npath: /x\nssh: {{options: ['{option}']}}")
    assert w.ssh.options == (option,)


# --------------------------------------------------------------------------------------------
# YAML details: merge keys and floats
# --------------------------------------------------------------------------------------------

MERGED = """
x-defaults: &defaults
  nproc: 4
  path: /srv/job
  env: {OMP_NUM_THREADS: "4"}
x-fast: &fast
  nproc: 8
workers:
  - <<: *defaults
    host: gpu1
  - <<: [*fast, *defaults]
    host: gpu2
    path: /srv/other
"""


def test_merge_keys_merge_a_mapping_anchor_into_a_worker() -> None:
    w1, w2 = parse(MERGED).workers
    assert (w1.host, w1.nproc, w1.path, w1.env) == ("gpu1", 4, "/srv/job", {"OMP_NUM_THREADS": "4"})
    # The worker's own keys win, then the earlier mapping of the list, as in YAML's merge type.
    assert (w2.host, w2.nproc, w2.path) == ("gpu2", 8, "/srv/other")


def test_merge_keys_work_in_env_mappings_too() -> None:
    spec = parse("""
        x-e: &e {A: a, B: b}
        env: {<<: *e, B: own}
        workers: [{host: launcher, nproc: 1}]
    """)
    assert spec.env == {"A": "a", "B": "own"}


def test_a_problem_in_a_merged_value_points_at_the_line_where_it_is_written() -> None:
    err = error(MERGED.replace("nproc: 4", "nproc: four").replace("nproc: 8", "nprc: 8"))
    assert str(problem_at(err, "workers[0].nproc")) == (
        "cluster.yml:2: workers[0].nproc: expected an integer, got string 'four'"
    )
    assert problem_at(err, "workers[1].nprc").line == 6


def test_a_key_written_next_to_a_merge_is_not_a_duplicate_but_a_repeated_one_is() -> None:
    err = error("""
        x-d: &d {nproc: 1, path: /x}
        workers:
          - <<: *d
            host: gpu1
            nproc: 2
            nproc: 3
    """)
    assert [str(p) for p in err.problems] == [
        "cluster.yml:6: workers[0].nproc: duplicate key 'nproc' (first on line 5)"
    ]


def test_two_merge_keys_in_one_mapping_are_a_duplicate() -> None:
    err = error("""
        x-d: &d {nproc: 1}
        workers:
          - <<: *d
            <<: *d
            host: launcher
    """)
    assert problem_at(err, "workers[0].<<").message == "duplicate merge key '<<' (first on line 3)"


@pytest.mark.parametrize(
    ("value", "key", "message"),
    [
        ("3", "workers[0].<<", "expected a mapping or a list of mappings to merge "
                               "(e.g. <<: *defaults), got integer 3"),
        ("[*d, 3]", "workers[0].<<[1]", "expected a mapping to merge, got integer 3"),
    ],
)
def test_a_merge_of_something_else_than_mappings_gets_a_specific_message(
    value: str, key: str, message: str
) -> None:
    err = error(f"x-d: &d {{nproc: 1}}\nworkers:\n  - {{<<: {value}, host: launcher}}\n")
    assert problem_at(err, key).message == message


def test_a_mapping_that_merges_itself_is_refused() -> None:
    err = refused("workers:\n  - &w {host: launcher, nproc: 1, <<: *w}\n")
    assert "a merge includes itself" in str(err)


def test_extension_keys_at_the_top_level_are_ignored() -> None:
    spec = parse("x-anything: {whatever: [1, 2]}\nworkers: [{host: launcher, nproc: 1}]")
    assert spec.workers[0].nproc == 1


@pytest.mark.parametrize("written", ["1.0e9", "1e9", "2.0", "2.", "1.0e+9", ".5"])
@pytest.mark.parametrize("key", ["nproc", "local_devices[0]"])
def test_a_float_where_an_integer_is_expected_is_called_a_float(written: str, key: str) -> None:
    snippet = f"nproc: {written}" if key == "nproc" else f"local_devices: [{written}]"
    err = worker_error(f"host: launcher\n{snippet}")
    message = problem_at(err, f"workers[0].{key}").message
    assert message.startswith("expected ") and "an integer" in message
    assert message.endswith(f"got float {written}")


def test_a_quoted_number_is_still_a_string() -> None:
    err = worker_error("host: launcher\nnproc: '1.0e9'")
    assert problem_at(err, "workers[0].nproc").message == "expected an integer, got string '1.0e9'"


@pytest.mark.parametrize(("written", "value"), [("1e1", 10.0), ("2.5e0", 2.5), ("1.0e+1", 10.0)])
def test_numbers_accept_floats_in_yaml_1_2_notation(written: str, value: float) -> None:
    spec = parse(f"kill_grace: {written}\nworkers: [{{host: launcher, nproc: 1}}]")
    assert spec.kill_grace == value


# --------------------------------------------------------------------------------------------
# Properties: whatever the input, a ClusterSpec or a ConfigError, in bounded memory
# --------------------------------------------------------------------------------------------

_SCHEMA_KEYS = [
    "controller", "command", "env", "kill_grace", "master_port", "elastic", "workers", "host",
    "port", "max_failure", "formation_timeout", "heartbeat_timeout", "nproc", "local_devices",
    "path", "addr", "nccl_socket_ifname", "ssh", "tunnel", "data_path", "target", "user",
    "identity_file", "options",
]
_KEYS = st.sampled_from([*_SCHEMA_KEYS, "<<", "x-d", "A", "NCCL_DEBUG", "Port", "a b", ""])
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["all", "launcher", "localhost", "10.0.0.1", "::1", "Port=0", "25%",
                     "User=a\nProxyCommand x", "~", "1.0e9", "a;b", "-x", "*"]),
    st.text(max_size=30),
)
_DOCUMENTS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.one_of(_KEYS, st.text(max_size=8)),
                                                     inner, max_size=6)
    ),
    max_leaves=40,
)
_YAMLISH = st.text(alphabet="[]{}:,-&*!<>|'\"\\#%@ \n\tax01.e+~", max_size=200)
PEAK_MB = 20


def _outcome_is_a_spec_or_a_config_error(call: Callable[[], ClusterSpec]) -> None:
    tracemalloc.start()
    try:
        assert isinstance(call(), ClusterSpec)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, Problem) for p in exc.problems)
        assert all("\n" not in str(p) for p in exc.problems)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < PEAK_MB * 2**20, f"peak {peak / 2**20:.1f} MB"


@settings(deadline=None, max_examples=150)
@given(document=st.dictionaries(_KEYS, _DOCUMENTS, max_size=8))
def test_any_yaml_document_gives_a_spec_or_a_config_error(document: dict[str, Any]) -> None:
    text = yaml.safe_dump(document, allow_unicode=True)
    _outcome_is_a_spec_or_a_config_error(
        lambda: parse_cluster(text, local_hostname=LOCAL, folder=FOLDER)
    )


@settings(deadline=None, max_examples=150)
@given(text=st.one_of(_YAMLISH, st.text(max_size=200)))
def test_any_text_gives_a_spec_or_a_config_error(text: str) -> None:
    _outcome_is_a_spec_or_a_config_error(
        lambda: parse_cluster(text, local_hostname=LOCAL, folder=FOLDER)
    )


@settings(deadline=None, max_examples=100)
@given(data=st.binary(max_size=300))
def test_any_bytes_in_a_file_give_a_spec_or_a_config_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        file = os.path.join(folder, "cluster.yml")
        with open(file, "wb") as stream:
            stream.write(data)
        _outcome_is_a_spec_or_a_config_error(lambda: load_cluster(file, local_hostname=LOCAL))


@settings(deadline=None, max_examples=300)
@given(text=st.text(alphabet=" \t\r\n'\"\\ab\x0b\u00a0", max_size=40))
def test_shell_words_splits_exactly_like_shlex(text: str) -> None:
    try:
        expected: object = shlex.split(text)
    except ValueError as exc:
        expected = str(exc)
    try:
        got: object = shell_words(text)
    except ValueError as exc:
        got = str(exc)
    assert got == expected


def test_shell_words_is_linear_in_the_length_of_a_word() -> None:
    with returns_fast(1.0):
        assert shell_words("a" * (4 << 20)) == ["a" * (4 << 20)]


def test_a_workers_transport_is_a_name_or_a_block_naming_its_kind() -> None:
    def worker(transport: str) -> str:
        return ("workers:\n  - host: a\n    nproc: 1\n    path: /w\n    addr: 127.0.0.1\n"
                f"    transport: {transport}\n")

    named = parse_cluster(worker("ssh"), file="c.yml", folder="/tmp").workers[0]
    assert (named.transport, dict(named.transport_settings), named.transport_line) == \
        ("ssh", {}, 6)
    block = parse_cluster(worker("\n      kind: pod\n      namespace: train\n      gpus: [0, 1]"),
                          file="c.yml", folder="/tmp").workers[0]
    assert block.transport == "pod"
    assert dict(block.transport_settings) == {"namespace": "train", "gpus": [0, 1]}
    inferred = parse_cluster(worker("ssh").replace("    transport: ssh\n", ""), file="c.yml",
                             folder="/tmp").workers[0]
    assert inferred.transport is None, "the transport package infers it, nobody else"
    for bad, line, said in (
            ("Kube Pods", 6, "a transport is named by a short lowercase word"),
            ("\n      namespace: train", 7, "a transport block names its kind")):
        with pytest.raises(ConfigError) as info:
            parse_cluster(worker(bad), file="c.yml", folder="/tmp")
        assert f"c.yml:{line}: workers[0].transport: {said}" in str(info.value)

"""The launch plan: rank numbering, each rank's environment and command."""

from __future__ import annotations

import textwrap

import pytest

from fdl_fabric.agent import wire
from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.planning.envelope import PrebuiltBinary, SlimEnvelope
from fdl_fabric.planning.plan import beats_every, build_plan

SALT = bytes(range(16))

CLUSTER = textwrap.dedent("""\
    controller: {host: 10.0.0.1, port: 1337}
    master_port: 29600
    env: {SHARED: cluster, NCCL_DEBUG: WARN}
    workers:
      - host: ctl
        nproc: 2
      - host: gpu-a
        path: /srv/a
        local_devices: [3, 1]
        nccl_socket_ifname: eth0
        env: {SHARED: host}
        ssh: {target: 10.0.0.2}
      - host: gpu-b
        path: /srv/b
        local_devices: all
        tunnel: true
""")


def _plan(text: str = CLUSTER, **kw: object):  # type: ignore[no-untyped-def]
    cluster = parse_cluster(text, file="cluster.yml", folder="/proj", local_hostname="ctl")
    args: dict[str, object] = dict(argv=["python3", "train.py", "--lr", "0.1"], run_id="run1",
                                   salt=SALT, resolved_devices={"gpu-b": [0]},
                                   launcher_env={})
    args.update(kw)
    return build_plan(cluster, **args)  # type: ignore[arg-type]


def test_ranks_are_numbered_in_roster_order() -> None:
    plan = _plan()
    assert [(r.host, r.rank, r.local_rank, r.device) for r in plan.ranks] == [
        ("ctl", 0, 0, None), ("ctl", 1, 1, None),
        ("gpu-a", 2, 0, 3), ("gpu-a", 3, 1, 1),
        ("gpu-b", 4, 0, 0)]


def test_torchrun_compatible_environment() -> None:
    r = _plan().ranks[3]
    assert {k: r.env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                  "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    assert r.env["FLODL_INTERNAL_LOCAL_RANK"] == "1" and r.env["FLODL_HOST_NAME"] == "gpu-a"


def test_device_ranks_are_pinned_and_cpu_ranks_are_not() -> None:
    plan = _plan()
    assert plan.ranks[2].env["CUDA_VISIBLE_DEVICES"] == "3"
    assert plan.ranks[2].env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "CUDA_VISIBLE_DEVICES" not in plan.ranks[0].env


def test_host_env_wins_over_cluster_env() -> None:
    plan = _plan()
    assert plan.ranks[2].env["SHARED"] == "host" and plan.ranks[0].env["SHARED"] == "cluster"
    assert plan.ranks[4].env["NCCL_DEBUG"] == "WARN"


def test_socket_ifname_is_exported_for_nccl_and_gloo() -> None:
    env = _plan().ranks[2].env
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_verbosity_and_timeout_scale_are_forwarded_only_when_set() -> None:
    assert "FLODL_VERBOSITY" not in _plan().ranks[0].env
    env = _plan(launcher_env={"FLODL_VERBOSITY": "3", "FLODL_NET_TIMEOUT_SCALE": "2"}).ranks[4].env
    assert env["FLODL_VERBOSITY"] == "3" and env["FLODL_NET_TIMEOUT_SCALE"] == "2"


def test_envelope_is_never_part_of_the_rank_env_or_argv() -> None:
    plan = _plan()
    for r in plan.ranks:
        assert "FLODL_INTERNAL_CLUSTER_JSON" not in r.env
        assert SALT.hex() not in " ".join(r.argv)
    assert plan.rank_environment(plan.ranks[0])["FLODL_INTERNAL_CLUSTER_JSON"]


def test_each_worker_envelope_has_its_ranks_and_dial_address() -> None:
    plan = _plan()
    a = SlimEnvelope.from_hex(plan.envelope_hex("gpu-a"))
    b = SlimEnvelope.from_hex(plan.envelope_hex("gpu-b"))
    ctl = SlimEnvelope.from_hex(plan.envelope_hex("ctl"))
    assert a.ranks == (2, 3) and a.local_devices == (3, 1) and a.controller_host == "10.0.0.1"
    assert b.controller_host == "127.0.0.1"  # tunneled
    assert ctl.controller_host == "10.0.0.1" and ctl.local_devices is None
    assert a.world_size == 5 and a.num_workers == 3 and a.salt == SALT and a.run_id == "run1"


def test_prebuilt_host_runs_its_binary_from_its_subpath_with_ld_path() -> None:
    plan = _plan(prebuilt={"gpu-a": PrebuiltBinary("target/bin/train", "/lt/lib", "bench")})
    r = plan.ranks[2]
    assert r.argv == ("/srv/a/target/bin/train", "train.py", "--lr", "0.1")
    assert r.cwd == "/srv/a/bench" and r.env["LD_LIBRARY_PATH"] == "/lt/lib"
    assert plan.ranks[4].argv[0] == "python3"


def test_user_ld_library_path_beats_the_prebuild_one() -> None:
    text = CLUSTER.replace("env: {SHARED: host}", "env: {SHARED: host, LD_LIBRARY_PATH: /mine}")
    plan = _plan(text, prebuilt={"gpu-a": PrebuiltBinary("x", "/lt/lib")})
    assert plan.ranks[2].env["LD_LIBRARY_PATH"] == "/mine"


def test_prebuild_for_an_unknown_host_is_an_error() -> None:
    with pytest.raises(ValueError, match="not in the cluster"):
        _plan(prebuilt={"nope": PrebuiltBinary("x", "/l")})


def test_unresolved_all_devices_is_an_error() -> None:
    with pytest.raises(ValueError, match="not resolved"):
        _plan(resolved_devices={})


def test_prefix_labels_name_host_device_and_rank() -> None:
    plan = _plan()
    assert plan.ranks[0].label == "ctl:cpu:r0" and plan.ranks[2].label == "gpu-a:3:r2"


def test_an_agent_spec_holds_the_hosts_shared_env_once_and_each_ranks_own() -> None:
    plan = _plan()
    spec = plan.agent_spec("gpu-a", start_now=True)
    assert spec["version"] == wire.VERSION and spec["host"] == "gpu-a" and spec["start_now"]
    assert [r["rank"] for r in spec["ranks"]] == [2, 3]
    assert spec["env"]["WORLD_SIZE"] == "5" and "RANK" not in spec["env"]
    assert [r["env"]["RANK"] for r in spec["ranks"]] == ["2", "3"]
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in spec["ranks"]] == ["3", "1"]
    assert spec["envelope"] == plan.envelope_hex("gpu-a")
    assert spec["argv"] == list(plan.ranks[2].argv) and spec["cwd"] == plan.ranks[2].cwd


def test_agents_fold_heartbeats_a_tenth_of_the_timeout_apart_between_1_and_3_s() -> None:
    # At 1,024 hosts a BEATS frame a host a second was most of the launcher's idle CPU;
    # each rank's age in it is exact, so a frozen rank is still found within the timeout.
    assert _plan().agent_spec("gpu-a")["beats_every"] == 3.0  # heartbeat_timeout 30 s
    assert beats_every(20.0) == 2.0 and beats_every(4.0) == 1.0 and beats_every(600) == 3.0
    # Progress rides in them too: a short hang_timeout makes them go more often.
    assert beats_every(30.0, 15.0) == 1.5 and beats_every(30.0, 3.0) == 1.0
    assert beats_every(30.0, None) == 3.0

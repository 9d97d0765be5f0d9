"""The same interpreter and libraries everywhere: what a host's ranks' interpreter reports
(`agent.versions.gather`, run against real venvs) and how the hosts' reports are compared
(`preflight.versions.judge`)."""

from __future__ import annotations

import platform
import stat
import sys
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest
from venvutil import install, make_venv

from fdl_fabric.agent.versions import gather
from fdl_fabric.clusterfile.model import VersionsSpec
from fdl_fabric.preflight.report import CONTROLLER, Status
from fdl_fabric.preflight.versions import judge

# -- gather: the ranks' interpreter, asked for real ----------------------------------------


def _ask(python: str, cwd: Path, packages: Optional[list[str]] = None,
         timeout: float = 30, **extra: Any) -> dict[str, Any]:
    return gather({"python": python, "cwd": str(cwd), "packages": packages,
                   "timeout": timeout, **extra})


def _script(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


def test_gather_reads_the_package_versions_of_the_venv_the_ranks_run(tmp_path: Path) -> None:
    make_venv(tmp_path / ".venv", {"fdl-probe-pkg": "1.2.3"})
    facts = _ask(".venv/bin/python", tmp_path, ["fdl-probe-pkg", "not-installed-here"])
    assert facts["packages"] == {"fdl-probe-pkg": "1.2.3", "not-installed-here": None}
    assert facts["python"] == platform.python_version()
    assert facts["executable"] == str(tmp_path / ".venv" / "bin" / "python")
    assert facts["nccl"] is None and "error" not in facts


def test_a_relative_python_resolves_against_the_ranks_folder(tmp_path: Path) -> None:
    make_venv(tmp_path / "a" / ".venv", {"fdl-probe-pkg": "1.0"})
    make_venv(tmp_path / "b" / ".venv", {"fdl-probe-pkg": "2.0"})
    assert _ask(".venv/bin/python", tmp_path / "b", ["fdl-probe-pkg"])["packages"] == {
        "fdl-probe-pkg": "2.0"}


def test_without_a_package_list_torch_is_reported_only_when_installed(tmp_path: Path) -> None:
    bare = make_venv(tmp_path / "bare")
    assert _ask(str(bare), tmp_path)["packages"] == {}
    cpu = make_venv(tmp_path / "cpu")
    install(tmp_path / "cpu", "torch", "2.13.0", {
        "torch/__init__.py": "raise RuntimeError('a CPU build must not be imported')\n",
        "torch/version.py": "from typing import Optional\ncuda: Optional[str] = None\n"})
    facts = _ask(str(cpu), tmp_path)
    assert facts["packages"] == {"torch": "2.13.0"}
    assert facts["torch_cuda"] is None and facts["cuda_available"] is False
    assert facts["nccl"] is None and "torch_error" not in facts


_CUDA_TORCH = {
    "torch/version.py": "from typing import Optional\ncuda: Optional[str] = '12.4'\n",
    "torch/__init__.py": "from . import version, cuda\n",
    "torch/cuda/__init__.py": "from . import nccl\ndef is_available():\n    return {avail}\n",
    "torch/cuda/nccl.py": "def version():\n    return {nccl}\n",
}


@pytest.mark.parametrize("nccl,shown", [("(2, 21, 5)", "2.21.5"), ("21805", "2.18.5"),
                                        ("2708", "2.7.8")])
def test_nccl_version_is_read_when_torch_has_cuda(tmp_path: Path, nccl: str,
                                                   shown: str) -> None:
    python = make_venv(tmp_path / "v")
    install(tmp_path / "v", "torch", "2.13.0+cu124",
            {k: v.format(avail=True, nccl=nccl) for k, v in _CUDA_TORCH.items()})
    facts = _ask(str(python), tmp_path)
    assert facts["packages"] == {"torch": "2.13.0+cu124"}
    assert (facts["torch_cuda"], facts["cuda_available"], facts["nccl"]) == ("12.4", True, shown)


def test_no_nccl_on_a_host_where_cuda_is_not_available(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "v")
    install(tmp_path / "v", "torch", "2.13.0+cu124",
            {k: v.format(avail=False, nccl="(2, 21, 5)") for k, v in _CUDA_TORCH.items()})
    facts = _ask(str(python), tmp_path)
    assert (facts["torch_cuda"], facts["cuda_available"], facts["nccl"]) == ("12.4", False, None)


def test_a_torch_that_fails_to_import_is_said_not_fatal(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "v")
    files = dict(_CUDA_TORCH, **{"torch/__init__.py": "raise ImportError('libcudart.so.12')\n"})
    install(tmp_path / "v", "torch", "2.13.0", files)
    facts = _ask(str(python), tmp_path)
    assert facts["packages"] == {"torch": "2.13.0"} and facts["nccl"] is None
    assert facts["torch_error"] == "ImportError: libcudart.so.12"


def test_extra_env_reaches_the_interpreter(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "v")
    extra = make_venv(tmp_path / "other", {"fdl-probe-pkg": "4.5"})
    site = next(extra.parent.parent.glob("lib/python*/site-packages"))
    facts = _ask(str(python), tmp_path, ["fdl-probe-pkg"], env={"PYTHONPATH": str(site)})
    assert facts["packages"] == {"fdl-probe-pkg": "4.5"}


def test_a_banner_printed_before_the_versions_does_not_hide_them(tmp_path: Path) -> None:
    noisy = _script(tmp_path / "noisy", f'echo "welcome to this cluster"\nexec {sys.executable}'
                    ' "$@"\n')
    facts = _ask(str(noisy), tmp_path, ["psutil"])
    assert facts["packages"] == {"psutil": psutil.__version__}


def test_a_missing_interpreter_is_named_with_its_path(tmp_path: Path) -> None:
    assert _ask(".venv/bin/python", tmp_path) == {
        "error": f"interpreter not found at {tmp_path}/.venv/bin/python"}
    assert _ask("/nowhere/bin/python3", tmp_path) == {
        "error": "interpreter not found at /nowhere/bin/python3"}
    assert _ask("python3.99-fdl", tmp_path) == {
        "error": "interpreter python3.99-fdl not found on PATH"}
    assert _ask("x/python", tmp_path / "gone") == {
        "error": f"cannot resolve interpreter x/python: the ranks' folder {tmp_path}/gone "
                 "does not exist"}


def test_an_interpreter_that_is_not_executable_is_said(tmp_path: Path) -> None:
    (tmp_path / "python").write_text("")
    (tmp_path / "python").chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert _ask("./python", tmp_path) == {
        "error": f"interpreter at {tmp_path}/python is not executable"}


def test_an_interpreter_that_fails_is_named_with_its_last_stderr_line(tmp_path: Path) -> None:
    bad = _script(tmp_path / "bad", "echo 'first' >&2\necho 'Fatal: no encodings' >&2\n"
                  "exit 1\n")
    assert _ask(str(bad), tmp_path) == {
        "error": f"interpreter {bad} exited 1: Fatal: no encodings"}


def test_an_interpreter_that_prints_no_versions_is_said(tmp_path: Path) -> None:
    odd = _script(tmp_path / "odd", "echo 'Python 2.7.18'\n")
    assert _ask(str(odd), tmp_path) == {
        "error": f"interpreter {odd} printed no versions: Python 2.7.18"}


@pytest.mark.timeout(30)
def test_an_interpreter_that_hangs_is_killed_with_its_children(tmp_path: Path) -> None:
    hang = _script(tmp_path / "hang", f"sleep 300 &\necho $! > {tmp_path}/child\n"
                   "exec sleep 300\n")
    assert _ask(str(hang), tmp_path, timeout=1) == {
        "error": f"interpreter {hang} timed out after 1 s (killed)"}
    child = psutil.Process(int((tmp_path / "child").read_text()))
    try:
        child.wait(timeout=10)  # a grandchild: gone, or a zombie awaiting its new parent
    except psutil.TimeoutExpired:
        assert child.status() == psutil.STATUS_ZOMBIE


def test_a_slow_interpreter_keeps_the_agent_heard(tmp_path: Path) -> None:
    slow = _script(tmp_path / "slow", f"sleep 2\nexec {sys.executable} \"$@\"\n")
    beats: list[float] = []
    facts = gather({"python": str(slow), "cwd": str(tmp_path), "packages": ["psutil"],
                    "timeout": 30}, beat=beats.append)
    assert facts["packages"] == {"psutil": psutil.__version__}
    assert beats and set(beats) == {0.0}


def _facts(python: str = "3.11.4", nccl: Optional[str] = None,
           **packages: Optional[str]) -> dict[str, Any]:
    return {"python": python, "executable": "/x/bin/python", "packages": dict(packages),
            "torch_cuda": None, "cuda_available": None, "nccl": nccl}


def _reasons(rows: list[Any]) -> list[tuple[str, str, str]]:
    return [(r.host, r.status.value, r.reason) for r in rows]


def test_torch_version_mismatch_names_the_host_that_differs() -> None:
    facts = {"gpu-a": _facts(torch="2.13.0"), "gpu-b": _facts(torch="2.13.0"),
             "gpu-c": _facts(torch="2.12.1"), "gpu-d": _facts(torch="2.13.0")}
    assert _reasons(judge(facts, VersionsSpec())) == [
        ("gpu-c", "warn", "torch 2.12.1 on gpu-c, 2.13.0 on 3 others")]


def test_strict_versions_makes_a_mismatch_a_failure() -> None:
    facts = {"a": _facts("3.11.4"), "b": _facts("3.11.4"), "c": _facts("3.10.12")}
    rows = judge(facts, VersionsSpec(strict=True))
    assert _reasons(rows) == [("c", "FAIL", "python 3.10.12 on c, 3.11.4 on 2 others")]
    assert all(r.name == "versions" for r in rows)


def test_when_all_agree_one_ok_row_names_the_versions() -> None:
    facts = {h: _facts(torch="2.13.0", nccl="2.21.5") for h in ("a", "b", "c")}
    assert _reasons(judge(facts, VersionsSpec())) == [
        (CONTROLLER, "ok", "python 3.11.4, torch 2.13.0, NCCL 2.21.5 on all 3 hosts")]


def test_one_row_per_thing_that_differs() -> None:
    facts = {"a": _facts("3.11.4", "2.21.5", torch="2.13.0", numpy="1.26.4"),
             "b": _facts("3.11.4", "2.21.5", torch="2.13.0", numpy="1.26.4"),
             "c": _facts("3.11.9", "2.20.3", torch="2.12.1", numpy="1.26.4")}
    assert _reasons(judge(facts, VersionsSpec(packages=("torch", "numpy")))) == [
        ("c", "warn", "python 3.11.9 on c, 3.11.4 on 2 others"),
        ("c", "warn", "torch 2.12.1 on c, 2.13.0 on 2 others"),
        ("c", "warn", "NCCL 2.20.3 on c, 2.21.5 on 2 others")]


def test_a_package_missing_on_some_hosts_is_named() -> None:
    facts = {"gpu-a": _facts(numpy="1.26.4"), "gpu-b": _facts(numpy=None),
             "gpu-c": _facts(numpy="1.26.4")}
    assert _reasons(judge(facts, VersionsSpec(packages=("numpy",)))) == [
        ("gpu-b", "warn", "numpy not installed on gpu-b, 1.26.4 on 2 others")]


def test_torch_missing_on_a_host_counts_when_the_list_is_the_default() -> None:
    facts = {"a": _facts(torch="2.13.0"), "b": _facts(), "c": _facts(torch="2.13.0")}
    assert _reasons(judge(facts, VersionsSpec())) == [
        ("b", "warn", "torch not installed on b, 2.13.0 on 2 others")]


def test_a_listed_package_absent_everywhere_agrees() -> None:
    facts = {"a": _facts(numpy=None), "b": _facts(numpy=None)}
    assert _reasons(judge(facts, VersionsSpec(packages=("numpy",)))) == [
        (CONTROLLER, "ok", "python 3.11.4, numpy not installed on all 2 hosts")]


def test_a_tie_names_each_value_with_its_hosts() -> None:
    facts = {"a": _facts(torch="2.13.0"), "b": _facts(torch="2.12.1"),
             "c": _facts(torch="2.12.1"), "d": _facts(torch="2.13.0")}
    assert _reasons(judge(facts, VersionsSpec())) == [
        ("a", "warn", "torch 2.13.0 on a and d, 2.12.1 on b and c")]


def test_several_minorities_are_each_named_before_the_majority() -> None:
    facts = {"a": _facts(torch="2.13.0"), "b": _facts(torch="2.13.0"),
             "c": _facts(torch="2.13.0"), "d": _facts(torch="2.12.1"),
             "e": _facts(torch="2.11.0")}
    assert _reasons(judge(facts, VersionsSpec())) == [
        ("d", "warn", "torch 2.12.1 on d, 2.11.0 on e, 2.13.0 on 3 others")]


def test_many_differing_hosts_are_named_up_to_five_then_counted() -> None:
    facts = {f"h{i:02}": _facts(torch="2.13.0" if i < 20 else "2.12.1") for i in range(32)}
    (row,) = judge(facts, VersionsSpec())
    assert row.reason == "torch 2.12.1 on h20, h21, h22, h23, h24 and 7 more, " \
                         "2.13.0 on 20 others"
    scattered = {f"h{i:02}": _facts(torch=f"2.{i}.0" if i >= 20 else "2.13.0")
                 for i in range(32)}
    (row,) = judge(scattered, VersionsSpec())
    assert row.reason == ("torch 2.20.0 on h20, 2.21.0 on h21, 2.22.0 on h22, 2.23.0 on h23, "
                          "2.24.0 on h24, 7 other values on 7 more hosts, 2.13.0 on 20 others")


def test_nccl_is_compared_only_between_hosts_that_have_one() -> None:
    facts = {"gpu-a": _facts(nccl="2.21.5"), "gpu-b": _facts(nccl="2.21.5"),
             "cpu-box": _facts(nccl=None)}
    assert _reasons(judge(facts, VersionsSpec())) == [
        (CONTROLLER, "ok", "python 3.11.4, NCCL 2.21.5 on all 3 hosts")]


def test_a_host_whose_versions_are_unknown_is_its_own_row() -> None:
    facts = {"a": _facts(torch="2.13.0"), "b": {"error": "interpreter not found at "
                                                          "/srv/b/.venv/bin/python"},
             "c": _facts(torch="2.13.0")}
    assert _reasons(judge(facts, VersionsSpec())) == [
        ("b", "warn", "versions unknown: interpreter not found at /srv/b/.venv/bin/python"),
        (CONTROLLER, "ok", "python 3.11.4, torch 2.13.0 on the 2 hosts that answered")]
    assert [r.status for r in judge(facts, VersionsSpec(strict=True))] == [
        Status.FAIL, Status.OK]


def test_a_malformed_report_is_a_row_not_a_crash() -> None:
    facts: dict[str, Any] = {"a": _facts(), "b": {"python": "3.11.4"}, "c": ["junk"],
                             "d": _facts(python="3.11.4\x1b[2J" + "9" * 500)}
    rows = judge(facts, VersionsSpec())
    assert [(r.host, r.reason.split(":")[0]) for r in rows[:2]] == [
        ("b", "versions unknown"), ("c", "versions unknown")]
    assert len(rows[2].reason) < 200 and rows[2].host in ("a", "d")


def test_one_host_agrees_with_itself() -> None:
    assert _reasons(judge({"a": _facts(torch="2.13.0")}, VersionsSpec())) == [
        (CONTROLLER, "ok", "python 3.11.4, torch 2.13.0 on its one host")]
    assert judge({}, VersionsSpec()) == []


def test_two_real_venvs_with_different_versions_are_told_apart(tmp_path: Path) -> None:
    for host, version in (("gpu-a", "1.0.0"), ("gpu-b", "1.0.0"), ("gpu-c", "1.1.0")):
        make_venv(tmp_path / host / ".venv", {"fdl-probe-pkg": version})
    facts = {h: _ask(".venv/bin/python", tmp_path / h, ["fdl-probe-pkg"])
             for h in ("gpu-a", "gpu-b", "gpu-c")}
    facts["gpu-d"] = _ask(".venv/bin/python", tmp_path / "nowhere", ["fdl-probe-pkg"])
    assert _reasons(judge(facts, VersionsSpec(packages=("fdl-probe-pkg",), strict=True))) == [
        ("gpu-d", "FAIL", f"versions unknown: cannot resolve interpreter .venv/bin/python: "
                          f"the ranks' folder {tmp_path}/nowhere does not exist"),
        ("gpu-c", "FAIL", "fdl-probe-pkg 1.1.0 on gpu-c, 1.0.0 on 2 others")]

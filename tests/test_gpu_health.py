"""GPU health in the pre-flight: what nvidia-smi, the kernel log and a small matmul say of
each GPU a worker uses, judged into rows that name the host, the GPU and the field.

The facts are gathered for real (`fdl_fabric.agent.gpus.gather` runs the commands) from a
stand-in ``nvidia-smi`` and ``dmesg`` on PATH that print captured outputs
(``tests/fixtures/nvidia-smi/``: real captures, and where a case was edited, its README
says what). A few cases are edited from a capture here, in the test, so the edit reads
beside the verdict. The local-worker and lab tests run the whole pre-flight and a launch.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest

from fdl_fabric.agent import gpus
from fdl_fabric.clusterfile import WorkerSpec, load_cluster, parse_cluster
from fdl_fabric.preflight import Check, ControllerFacts, HostFacts, HostPlan, Status, run_checks
from fdl_fabric.preflight.gpus import (
    gpus_row,
    health_rows,
    parse_q,
    parse_table_errors,
    parse_xids,
    pci_key,
)
from labutil import PROBE, ROOT, run_launch

FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi"
STANDIN = ROOT / "tests" / "progs" / "nvidia_smi_standin.py"
CTL = ControllerFacts(arch="x86_64", port=1337)
#: The kernel's refusal to a user who may not read its log (kernel.dmesg_restrict=1), as
#: util-linux's dmesg prints it (virt-s1/rhel-edge#5955).
DMESG_DENIED = "dmesg: read kernel buffer failed: Operation not permitted\n"


def _fakebin(where: Path) -> Path:
    """A folder with ``nvidia-smi`` and ``dmesg``: links to the stand-in."""
    fakebin = where / "fakebin"
    fakebin.mkdir(exist_ok=True)
    for name in ("nvidia-smi", "dmesg"):
        (fakebin / name).symlink_to(STANDIN)
    return fakebin


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """``standin(case, edit=None)``: the stand-in on PATH, printing ``case``'s captures;
    ``edit(folder)`` changes a copy of them first. Returns the case folder."""
    fakebin = _fakebin(tmp_path)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")

    def use(case: str, edit: Optional[Callable[[Path], None]] = None) -> Path:
        folder = FIXTURES / case
        if edit is not None:
            folder = tmp_path / "cases" / case
            shutil.copytree(FIXTURES / case, folder)
            edit(folder)
        monkeypatch.setenv("FDL_NVSMI_CASE", str(folder))
        return folder

    return use


def _replace(name: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        text = (folder / name).read_text()
        assert old in text, f"{old!r} is not in {name}"
        (folder / name).write_text(text.replace(old, new))
    return edit


def _worker(devices: Any, host: str = "gpu1") -> WorkerSpec:
    doc = {"workers": [{"host": host, "path": "/srv/proj", "local_devices": devices}]}
    return parse_cluster(json.dumps(doc), file="c.yml", folder="/proj",
                         local_hostname="ctl").workers[0]


def _plan(devices: Any, *, fast: bool = False, python: str = "python3") -> HostPlan:
    return HostPlan(worker=_worker(devices), fast=fast, argv=(python, "train.py"))


def _gathered(plan: HostPlan, **overrides: str) -> dict[str, str]:
    """What the host's agent gathers for ``plan`` (the matmul left out unless given)."""
    wanted = {"listing": not plan.fast, "health": True, "matmul": False,
              "devices": list(plan.worker.local_devices)
              if isinstance(plan.worker.local_devices, tuple) else "all"}
    values = gpus.gather(wanted, "/tmp", lambda _: None)
    values.update(overrides)
    return values


def _health(devices: Any, *, fast: bool = False, **overrides: str) -> list[Check]:
    plan = _plan(devices, fast=fast)
    return health_rows(plan, HostFacts(_gathered(plan, **overrides)), CTL)


def _only(rows: list[Check], status: Status) -> list[Check]:
    return [r for r in rows if r.status is status]


# --------------------------------------------------------------------------------------------
# Healthy
# --------------------------------------------------------------------------------------------


def test_a_healthy_gpu_gets_one_ok_row_saying_what_was_checked(standin: Any) -> None:
    standin("healthy-h200")
    assert _health([0]) == [Check(
        "gpu1", "gpu_health", Status.OK,
        "GPU 0 healthy: no uncorrectable ECC error, no retired page or row remap pending, "
        "every field readable, not throttled, no Xid in the kernel log")]


def test_not_applicable_fields_and_an_idle_gpu_are_not_faults(standin: Any) -> None:
    # The H200 capture is full of N/A and [N/A] ("Pending Page Blacklist : N/A", its CSV's
    # power cells) and its clocks read "Idle : Active": none of it is a fault.
    standin("healthy-h200")
    q = parse_q((FIXTURES / "healthy-h200" / "q.txt").read_text())
    leaves = q[(0, 0x83, 0)]
    assert leaves[("Retired Pages", "Pending Page Blacklist")] == "N/A"
    assert leaves[("Clocks Event Reasons", "Idle")] == "Active"
    assert leaves[("ECC Errors", "Volatile", "DRAM Uncorrectable")] == "0"
    assert all(r.status is Status.OK for r in _health("all"))


# --------------------------------------------------------------------------------------------
# FAIL: memory errors, unreadable fields, a driver that does not answer
# --------------------------------------------------------------------------------------------


def test_an_uncorrectable_ecc_error_fails_naming_the_gpu_and_field(standin: Any) -> None:
    standin("ecc-h200")
    (row,) = _only(_health([0]), Status.FAIL)
    assert row.host == "gpu1" and row.name == "gpu_health"
    assert row.reason.startswith(
        "GPU 0: uncorrectable ECC errors: ECC Errors/Volatile/DRAM Uncorrectable = 2, "
        "ECC Errors/Aggregate/DRAM Uncorrectable = 2 (its memory returned data it could "
        "not correct")
    assert _only(_health([0]), Status.OK) == []  # the one GPU is not called healthy


def test_a_pending_row_remap_fails_naming_the_gpu_and_field(standin: Any) -> None:
    standin("remap-a10")  # an A10 whose Remapped Rows read "Pending : Yes" (gpud's capture)
    (row,) = _only(_health([0]), Status.FAIL)
    assert row.reason == ("GPU 0: row remapping pending: Remapped Rows/Pending = Yes (the "
                          "remap takes effect at the next GPU reset: reset the GPU)")


def test_a_failed_row_remap_fails_naming_the_gpu_and_field(standin: Any) -> None:
    standin("remap-a10", _replace("q.txt", "Remapping Failure Occurred        : No",
                                  "Remapping Failure Occurred        : Yes"))
    reasons = [r.reason for r in _only(_health([0]), Status.FAIL)]
    assert "GPU 0: row remapping failed: Remapped Rows/Remapping Failure Occurred = Yes (no " \
           "spare row was left: the GPU needs replacing)" in reasons


def test_a_retired_page_pending_fails_naming_the_gpu_and_field(standin: Any) -> None:
    # GPUs before Ampere retire pages instead of remapping rows: the same section, with a
    # count instead of N/A, and "Pending Page Blacklist : Yes" until the GPU is reset.
    standin("remap-a10", _replace("q.txt", "Pending Page Blacklist            : N/A",
                                  "Pending Page Blacklist            : Yes"))
    reasons = [r.reason for r in _only(_health([0]), Status.FAIL)]
    assert "GPU 0: retired page pending: Retired Pages/Pending Page Blacklist = Yes (the " \
           "page is retired at the next GPU reset: reset the GPU)" in reasons


def test_err_in_nvidia_smis_table_fails_even_though_it_exits_0(standin: Any) -> None:
    # pytorch/test-infra#3967: a crashed A10G, nvidia-smi exiting 0 with ERR! in its table.
    standin("err-a10g")
    table = (FIXTURES / "err-a10g" / "table.txt").read_text()
    assert parse_table_errors(table) == {0: [
        "Name", "Volatile Uncorr. ECC", "Fan", "Temp", "Perf", "Pwr:Usage/Cap",
        "Pwr:Usage/Cap", "GPU-Util", "MIG M."]}
    (row,) = _only(_health([0]), Status.FAIL)
    assert row.reason == (
        "GPU 0: unreadable ([Unknown Error], ERR!): uuid, name, pstate, temperature.gpu, "
        "power.draw, utilization.gpu, Name, Volatile Uncorr. ECC, Fan, Temp, Perf, "
        "Pwr:Usage/Cap, GPU-Util, MIG M. (the driver cannot read the GPU: reset it or reboot "
        "the host)")


def test_unknown_error_in_a_health_counter_fails_naming_the_field(standin: Any) -> None:
    standin("remap-a10", _replace("q.txt", "DRAM Uncorrectable            : 0",
                                  "DRAM Uncorrectable            : Unknown Error"))
    reasons = [r.reason for r in _only(_health([0]), Status.FAIL)]
    assert "GPU 0: unreadable (Unknown Error): ECC Errors/Volatile/DRAM Uncorrectable, " \
           "ECC Errors/Aggregate/DRAM Uncorrectable (the driver cannot read the GPU: reset it " \
           "or reboot the host)" in reasons


def test_a_gpu_nvidia_smi_cannot_reach_fails_naming_its_pci_address(standin: Any) -> None:
    # nvidia-smi's words for a GPU it cannot open (xxd3vin/workspace#19), beside a good row.
    csv = (FIXTURES / "healthy-h200" / "query-gpu.csv").read_text().splitlines()
    line = "Unable to determine the device handle for GPU 0000:0B:00.0: Unknown Error"
    standin("healthy-h200", lambda f: (f / "query-gpu.csv").write_text(
        "\n".join(csv + [line]) + "\n"))
    rows = _health("all")
    assert Check("gpu1", "gpu_health", Status.FAIL,
                 f"GPU at PCI 0000:0b:00: nvidia-smi: {line}") in rows


def test_a_driver_that_does_not_answer_fails_a_launch_and_leaves_prebuild_check_to_gpus(
        standin: Any) -> None:
    standin("driver-gone")
    assert _health([0], fast=True) == [Check(
        "gpu1", "gpu_health", Status.FAIL,
        "nvidia-smi failed (status 9): NVIDIA-SMI has failed because it couldn't communicate "
        "with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and "
        "running.")]
    assert _health([0]) == []  # the gpus row says it, once


def test_without_nvidia_smi_a_launch_warns_and_prebuild_check_leaves_it_to_gpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    (row,) = _health([0], fast=True)
    assert row.status is Status.WARN and "nvidia-smi is not on this host's PATH" in row.reason
    assert _health([0]) == []


# --------------------------------------------------------------------------------------------
# warn: throttled clocks, Xid, other processes' memory
# --------------------------------------------------------------------------------------------


def test_throttled_clocks_warn_naming_each_gpu_and_reason(standin: Any) -> None:
    standin("throttled-h100")  # gpud's H100 capture: HW Slowdown and its power brake active
    warns = [r.reason for r in _only(_health([0, 4]), Status.WARN) if "clocks" in r.reason]
    assert warns == [
        f"GPU {i}: clocks throttled: Clocks Event Reasons/HW Slowdown = Active, Clocks Event "
        "Reasons/HW Power Brake Slowdown = Active (power, heat or the board slows it: ranks "
        "on it run slower)" for i in (0, 4)]
    assert _only(_health([0, 4]), Status.FAIL) == []  # a warning does not block a launch


def test_the_older_throttle_section_name_is_read_the_same(standin: Any) -> None:
    # Drivers before 535 call the section "Clocks Throttle Reasons" (NVML's
    # nvmlClocksThrottleReasons, renamed nvmlClocksEventReasons in R535).
    standin("throttled-h100", _replace("q.txt", "Clocks Event Reasons\n",
                                       "Clocks Throttle Reasons\n"))
    warns = [r.reason for r in _only(_health([0]), Status.WARN) if "clocks" in r.reason]
    assert warns and "Clocks Throttle Reasons/HW Slowdown = Active" in warns[0]


def test_an_xid_in_the_kernel_log_warns_naming_the_gpu(standin: Any) -> None:
    standin("throttled-h100")  # with gpud's dmesg capture of Xid 119 on PCI 0000:9b:00
    (row,) = [r for r in _health([0, 4]) if "Xid" in r.reason]
    assert row.status is Status.WARN
    assert row.reason.startswith("GPU 4: kernel log reports Xid 119 (5 since boot), last: "
                                 "[Sun Feb 23 16:30:13 2025] NVRM: Xid (PCI:0000:9b:00): 119,")
    assert parse_xids("NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.") == [
        ((0, 2, 0), 79, "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.")]


def test_an_unreadable_kernel_log_is_a_note_never_a_failure(standin: Any) -> None:
    standin("healthy-h200", lambda f: (f / "dmesg-denied.txt").write_text(DMESG_DENIED))
    (row,) = _health([0])
    assert row.status is Status.OK
    assert row.reason.endswith("not throttled; kernel log not readable (dmesg: read kernel "
                               "buffer failed: Operation not permitted): Xid not checked")


def test_other_processes_memory_is_said_once_with_pids_and_sizes(standin: Any) -> None:
    standin("busy-h200")  # the H200 under load: two memhogs and a gpu_burn
    pids = "pid 10291 (2566 MiB), 10293 (1542 MiB), 10309 (28234 MiB)"
    launch = _health([0], fast=True)
    assert Check("gpu1", "gpu_health", Status.WARN,
                 f"GPU 0: memory held by processes not of this run: {pids}") in launch
    plan = _plan([0])
    facts = HostFacts(_gathered(plan))
    busy = gpus_row(plan, facts, CTL)
    assert busy is not None and busy.status is Status.WARN
    assert f"GPU 0: {pids.removeprefix('pid ')}" in busy.reason.replace("pid ", "")
    assert all("processes" not in r.reason for r in health_rows(plan, facts, CTL))


def test_only_the_gpus_the_worker_uses_are_judged(standin: Any) -> None:
    standin("throttled-h100")
    rows = _health([0])
    assert [r.reason.split(":")[0] for r in rows] == ["GPU 0"]  # GPU 4's throttle and Xid: not ours


# --------------------------------------------------------------------------------------------
# The matmul
# --------------------------------------------------------------------------------------------


def test_a_matmul_mismatch_fails_naming_the_gpu(standin: Any) -> None:
    standin("healthy-h200")
    answer = json.dumps({"torch": "2.5.1", "results": {"0": {"ok": False, "max_diff": 3.5}}})
    (row,) = _only(_health([0], gpu_matmul=answer), Status.FAIL)
    assert row.reason == ("GPU 0: matmul differs from the CPU's: max difference 3.5 "
                          "(tolerance 1e-3)")


def test_a_matmul_error_fails_naming_the_gpu(standin: Any) -> None:
    standin("healthy-h200")
    answer = json.dumps({"results": {"0": {"error": "RuntimeError: CUDA error: an illegal "
                                                     "memory access was encountered"}}})
    (row,) = _only(_health([0], gpu_matmul=answer), Status.FAIL)
    assert row.reason == ("GPU 0: matmul failed: RuntimeError: CUDA error: an illegal memory "
                          "access was encountered")
    (crashed,) = _only(_health([0], gpu_matmul="error:exited -11"), Status.FAIL)
    assert crashed.reason == "GPU 0: matmul program failed: exited -11"


def test_a_matmul_that_does_not_finish_in_time_warns(standin: Any) -> None:
    # A hung GPU or only a slow import of torch: not a verdict on the GPU either way.
    standin("healthy-h200")
    late = "timeout:python3 gave no answer within 40 s (killed)"
    rows = _health([0], gpu_matmul=late)
    assert Check("gpu1", "gpu_health", Status.WARN, "GPU 0: matmul not checked: python3 gave "
                 "no answer within 40 s (killed)") in rows
    assert _only(rows, Status.FAIL) == []


def test_a_matmul_that_matches_says_so_and_one_without_cuda_is_a_note(standin: Any) -> None:
    standin("healthy-h200")
    good = json.dumps({"results": {"0": {"ok": True, "max_diff": 1.5e-05}}})
    (row,) = _health([0], gpu_matmul=good)
    assert row.status is Status.OK and row.reason.endswith("matmul matches the CPU")
    skip = json.dumps({"skip": "CUDA is not available to torch 2.5.1+cpu"})
    (row,) = _health([0], gpu_matmul=skip)
    assert row.status is Status.OK
    assert row.reason.endswith("; matmul not run: CUDA is not available to torch 2.5.1+cpu")


def test_the_matmul_program_runs_with_the_ranks_interpreter_and_its_pythonpath(
        tmp_path: Path) -> None:
    # This machine's torch has no CUDA: the real program says so, and that is no failure.
    # (A generous bound: importing torch on a busy shared machine can take long.)
    got = gpus.matmul("python3", [0], str(tmp_path), None, 100)
    assert got.startswith("{") and "CUDA is not available" in json.loads(got)["skip"], got
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")
    shadowed = json.loads(gpus.matmul("python3", [0], "/", str(tmp_path), 60))
    assert shadowed == {"skip": "torch is not importable (ImportError: no torch here)"}
    assert gpus.matmul(str(tmp_path / "nope" / "python3"), [0], "/", None, 60) == \
        f"skip:interpreter {tmp_path}/nope/python3 not found"
    # a bare "python3" is looked up on the ranks' PATH where cluster.yml sets one
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text("#!/bin/sh\necho '{\"skip\": \"theirs\"}'\n")
    (tmp_path / "bin" / "python3").chmod(0o755)
    assert gpus.matmul("python3", [0], "/", None, 60, path_env=str(tmp_path / "bin")) == \
        '{"skip": "theirs"}'


def test_pci_addresses_match_however_they_are_written() -> None:
    assert pci_key("00000000:9B:00.0") == pci_key("PCI:0000:9b:00") == (0, 0x9B, 0)
    assert pci_key("GPU-ee7954ec") is None


# --------------------------------------------------------------------------------------------
# Through the real thing: a local worker's agent, lab hosts over SSH, a launch
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _local_cluster(tmp_path: Path, devices: str, env: str = "{}") -> Path:
    (tmp_path / "train.py").write_text("print('train')\n")
    path = tmp_path / "cluster.yml"
    path.write_text(textwrap.dedent(f"""\
        controller: {{port: {_free_port()}}}
        workers: [{{host: localhost, local_devices: {devices}, path: {tmp_path}, env: {env}}}]
        """))
    return path


def test_prebuild_check_on_a_local_worker_fails_an_ecc_error_and_notes_the_matmul(
        standin: Any, tmp_path: Path) -> None:
    standin("ecc-h200")
    # The ranks' PYTHONPATH (cluster.yml's env) reaches the matmul program: here it hides
    # torch, which keeps this test quick (the real torch's answer is tested above).
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "torch.py").write_text("raise ImportError('no torch here')\n")
    cluster = _local_cluster(tmp_path, "[0]", env=f"{{PYTHONPATH: {tmp_path}/lib}}")
    report = run_checks(load_cluster(cluster), argv=["python3", "train.py"])
    rows = [c for c in report.checks if c.name == "gpu_health"]
    assert report.exit_code() == 1
    assert [r.status for r in rows] == [Status.FAIL, Status.OK], rows
    assert rows[0].host == "localhost" and rows[0].reason.startswith(
        "GPU 0: uncorrectable ECC errors: ECC Errors/Volatile/DRAM Uncorrectable = 2")
    # the ranks' interpreter ran the matmul program: without torch, a note, no FAIL
    assert rows[1].reason == "matmul not run: torch is not importable (ImportError: no " \
                             "torch here)"


def test_prebuild_check_fails_a_matmul_mismatch_the_ranks_interpreter_reports(
        standin: Any, tmp_path: Path) -> None:
    standin("healthy-h200")
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    fake = bindir / "python3"  # prints what the matmul program prints for a bad GPU
    answer = {"torch": "2.5.1", "results": {"0": {"ok": False, "max_diff": 7.25}}}
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{json.dumps(answer)}'\n")
    fake.chmod(0o755)
    report = run_checks(load_cluster(_local_cluster(tmp_path, "[0]")),
                        argv=[str(fake), "train.py"])
    assert Check("localhost", "gpu_health", Status.FAIL,
                 "GPU 0: matmul differs from the CPU's: max difference 7.25 (tolerance 1e-3)"
                 ) in report.checks
    assert report.exit_code() == 1


@pytest.mark.lab
def test_prebuild_check_names_the_lab_host_gpu_and_field_of_each_fault(
        sshd_lab: Any, tmp_path: Path) -> None:
    fakebin = _fakebin(tmp_path)
    lab = sshd_lab(n_hosts=1, login_shell_rc=(
        f"export PATH={fakebin}:$PATH FDL_NVSMI_CASE=remap-a10"))
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], local_devices=[0])])
    report = run_checks(load_cluster(cluster), argv=["true"])
    rows = [c for c in report.checks if c.name == "gpu_health"]
    assert report.exit_code() == 1
    assert Check("lab1", "gpu_health", Status.FAIL,
                 "GPU 0: row remapping pending: Remapped Rows/Pending = Yes (the remap takes "
                 "effect at the next GPU reset: reset the GPU)") in rows
    gpus_present = [c for c in report.checks if c.name == "gpus"]
    assert gpus_present == [Check("lab1", "gpus", Status.OK, "GPU 0 present, no compute process")]


@pytest.mark.lab
def test_a_launch_refuses_a_gpu_with_uncorrectable_ecc_errors_and_starts_nothing(
        sshd_lab: Any, tmp_path: Path) -> None:
    fakebin = _fakebin(tmp_path)
    lab = sshd_lab(n_hosts=1, login_shell_rc=(
        f"export PATH={fakebin}:$PATH FDL_NVSMI_CASE=ecc-h200"))
    cluster = lab.write_cluster([lab.worker(lab.hosts[0], local_devices=[0])])
    out = run_launch(cluster, "--cmd", f"python3 {PROBE} --dump {tmp_path}/d")
    assert out.returncode == 1, out.stderr
    assert ("pre-flight: lab1: gpu_health: FAIL: GPU 0: uncorrectable ECC errors: ECC "
            "Errors/Volatile/DRAM Uncorrectable = 2") in out.stderr
    assert "nothing was started" in out.stderr
    assert not (tmp_path / "d").exists()

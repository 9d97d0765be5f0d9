"""Secrets found by value, through real launches (issue 34, item 4): a cluster file with a
``DATABASE_URL`` holding a password, a token-shaped value and a ``secret_env`` variable,
and a command that carries a token. The dry run, the run's kept plan (``cluster.json``),
its events (events.jsonl, ``--json``), its record and ``status`` show none of them; the
ranks get every one, exactly.

The launch runs on this machine (a ``localhost`` worker: real agent, real processes),
once for the module; each test reads one of its traces. Every secret is fake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest

from labutil import PROBE, ROOT, launch_argv

PASSWORD = "Zq7-fake-Pw-0x41"
DATABASE_URL = f"postgres://trainer:{PASSWORD}@db.invalid:5432/runs"
SHOWN_URL = "postgres://trainer:***@db.invalid:5432/runs"
#: Token-shaped, under a name that says nothing.
BEARER = "Zk4Qp9sLx2Vb7Nw3Rt6Yh1Jm8Fc"
#: Ordinary words: a secret only because ``secret_env`` says so.
PASSPHRASE = "grey tabby on the keyboard"
#: On the command line (the user's choice): a GitHub token's shape.
GH_TOKEN = "ghp_FAKEa1B2c3D4e5F6g7H8i9J0k1L2m3N4o5"
SECRETS = (PASSWORD, BEARER, PASSPHRASE, GH_TOKEN)

#: Variables the test's own environment may set that would change what a launch says.
_UNSET = ("FLODL_VERBOSITY", "FLODL_NET_TIMEOUT_SCALE", "FLODL_INTERNAL_PREBUILD_PER_HOST",
          "FDL_FABRIC_STATE_DIR", "XDG_RUNTIME_DIR")


class Launched:
    """One real launch's traces: its output, its folders."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.runs = folder / "runs"
        self.logs = folder / "logs"
        self.dump = folder / "dump"
        self.cluster = folder / "secrets.yml"
        self.cluster.write_text(textwrap.dedent(f"""\
            secret_env: [APP_PASSPHRASE]
            env:
              DATABASE_URL: "{DATABASE_URL}"
              UPLOAD_BEARER: "{BEARER}"
              APP_PASSPHRASE: "{PASSPHRASE}"
              LR: "0.1"
            workers:
              - host: localhost
                nproc: 2
                path: {folder}
            """))
        self.env = {k: v for k, v in os.environ.items() if k not in _UNSET}
        self.env["FDL_FABRIC_RUNS_DIR"] = str(self.runs)
        # ``python -m fdl_fabric`` run from another folder imports this checkout, whatever
        # copy the interpreter has installed.
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.command = f"python3 {PROBE} --dump {self.dump} {GH_TOKEN}"
        #: The module's launch, once it ran.
        self.result: Optional[subprocess.CompletedProcess[str]] = None

    def launch(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(launch_argv(self.cluster, *args, "--cmd", self.command))

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=90, env=self.env,
                              cwd=str(self.folder), stdin=subprocess.DEVNULL)

    def record(self) -> Path:
        (folder,) = [p for p in self.runs.iterdir() if p.is_dir()]
        return folder


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """The launch, run to its end with --log-dir and --json."""
    run = Launched(tmp_path_factory.mktemp("masking"))
    run.result = run.launch("--log-dir", str(run.logs), "--json")
    assert run.result.returncode == 0, run.result.stderr
    return run


def _without_secrets(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} shows {secret!r}"


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_the_ranks_get_every_secret_exactly(launched: Launched) -> None:
    for rank in (0, 1):
        got = json.loads((launched.dump / f"env-r{rank}.json").read_text())
        assert got["env"]["DATABASE_URL"] == DATABASE_URL
        assert got["env"]["UPLOAD_BEARER"] == BEARER
        assert got["env"]["APP_PASSPHRASE"] == PASSPHRASE
        assert got["argv"][-1] == GH_TOKEN


def test_the_runs_kept_plan_masks_the_password_the_token_and_secret_env(
        launched: Launched) -> None:
    text = (launched.record() / "cluster.json").read_text()
    _without_secrets(text, "the record's cluster.json")
    plan = json.loads(text)
    assert plan["env"] == {"DATABASE_URL": SHOWN_URL, "UPLOAD_BEARER": "***",
                           "APP_PASSPHRASE": "***", "LR": "0.1"}
    for rank in plan["ranks"]:
        assert rank["env"]["DATABASE_URL"] == SHOWN_URL and rank["env"]["LR"] == "0.1"
        assert rank["argv"][-1] == "***"


def test_every_file_of_the_runs_record_but_the_ranks_own_output_is_masked(
        launched: Launched) -> None:
    record = launched.record()
    kept = [p for p in record.rglob("*") if p.is_file() and "attempt_" not in str(p)]
    assert {p.name for p in kept} >= {"state.json", "events.jsonl", "cluster.json",
                                      "console.log", "result.json"}
    for path in kept:
        _without_secrets(path.read_text(errors="replace"), str(path.relative_to(record)))
    state = json.loads((record / "state.json").read_text())
    assert state["command"].endswith(f"{launched.dump} '***'") or \
        state["command"].endswith(f"{launched.dump} ***")


def test_events_and_json_lines_are_masked(launched: Launched) -> None:
    result = launched.result
    assert result is not None
    _without_secrets(result.stdout, "--json")
    assert _json_lines(result.stdout)[-1]["name"] == "verdict"
    (folder,) = [p for p in launched.logs.iterdir() if p.is_dir() and not p.is_symlink()]
    _without_secrets((folder / "events.jsonl").read_text(), "--log-dir's events.jsonl")
    _without_secrets((folder / "cluster.json").read_text(), "--log-dir's cluster.json")
    _without_secrets(result.stderr, "the console")


def test_status_shows_the_runs_command_masked(launched: Launched) -> None:
    out = launched.run([sys.executable, "-m", "fdl_fabric", "status", "--all", "--json"])
    assert out.returncode == 0, out.stderr
    _without_secrets(out.stdout + out.stderr, "status")
    (row,) = json.loads(out.stdout)["controller"]["runs"]
    assert row["command"].startswith("python3 ") and "***" in row["command"]


def test_a_dry_run_and_its_json_mask_them_too(tmp_path: Path) -> None:
    run = Launched(tmp_path)
    words = run.launch("--dry-run")
    assert words.returncode == 0, words.stderr
    _without_secrets(words.stdout + words.stderr, "--dry-run")
    assert f"DATABASE_URL='{SHOWN_URL}'" in words.stdout
    assert "UPLOAD_BEARER='***'" in words.stdout and "APP_PASSPHRASE='***'" in words.stdout
    assert "LR=0.1" in words.stdout
    lines = run.launch("--dry-run", "--json")
    assert lines.returncode == 0, lines.stderr
    _without_secrets(lines.stdout, "--dry-run --json")
    (dry,) = [r for r in _json_lines(lines.stdout) if r["name"] == "dry_run"]
    assert dry["data"]["hosts"][0]["env"]["DATABASE_URL"] == SHOWN_URL
    assert not run.dump.exists()  # nothing ran


def test_a_bad_secret_env_is_refused_with_exit_2_naming_file_and_line(tmp_path: Path) -> None:
    run = Launched(tmp_path)
    run.cluster.write_text(run.cluster.read_text().replace(
        "secret_env: [APP_PASSPHRASE]", 'secret_env: ["APP PASSPHRASE"]'))
    out = run.launch("--dry-run")
    assert out.returncode == 2
    assert f"{run.cluster}:1: secret_env[0]: expected a variable name" in out.stderr
    assert not run.dump.exists()

"""Real virtual environments for the tests of ``python:`` and of the version check.

``python3 -m venv --without-pip`` makes one in about 0.1 s. A "package" is installed the
way ``importlib.metadata`` finds one: a ``<name>-<version>.dist-info`` folder with its
``METADATA`` (and a ``RECORD``) in the venv's site-packages, plus whatever module files
the test wants importable. No registry, no network, no wheel build.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def make_venv(folder: Path, packages: Mapping[str, str] = {}) -> Path:  # noqa: B006
    """A venv at ``folder`` (the launcher's own Python) with ``packages`` (name ->
    version) installed; returns its ``bin/python``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True,
                   capture_output=True, timeout=60)
    for name, version in packages.items():
        install(folder, name, version)
    return folder / "bin" / "python"


def site_packages(venv: Path) -> Path:
    """The venv's site-packages (``lib/pythonX.Y/site-packages``)."""
    found = sorted(venv.glob("lib/python*/site-packages"))
    assert found, f"{venv} has no site-packages"
    return found[0]


def install(venv: Path, name: str, version: str,
            files: Mapping[str, str] = {}) -> None:  # noqa: B006
    """Install distribution ``name`` ``version`` into ``venv``: its metadata, and
    ``files`` (path relative to site-packages -> text) as its modules."""
    where = site_packages(venv)
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, text in files.items():
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    record = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,", *(f"{r},," for r in files)]
    (info / "RECORD").write_text("\n".join(record) + "\n")


def make_wheel(folder: Path, name: str, version: str) -> Path:
    """A real wheel of a one-module package ``name`` (``name.VERSION == version``), built
    here by hand (a zip with its dist-info), which pip installs like any other."""
    import base64
    import hashlib
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: venvutil\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(path, "w") as whl:
        for arc, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{arc},sha256={digest.decode()},{len(data)}")
            whl.writestr(arc, data)
        record.append(f"{info}/RECORD,,")
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path

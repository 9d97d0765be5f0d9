"""Values are quoted exactly: a property test through a real sshd.

Hypothesis draws env values, arguments and a working-directory name full of
quotes, newlines, `$()`, backticks, spaces and unicode; each example starts one
remote agent through the launcher's own path (one SSH session on a shared
Connection, its spec on stdin) and the rank reports what it received, byte for
byte.
"""

from __future__ import annotations

import json
import queue
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdl_fabric import reports
from fdl_fabric.clusterfile import parse_cluster
from fdl_fabric.planning.envelope import new_salt
from fdl_fabric.planning.plan import build_plan
from fdl_fabric.transport import for_worker
from fdl_fabric.transport.session import AgentSession
from fdl_fabric.transport.sshconfig import resolve_settings

pytestmark = pytest.mark.lab

REPORT = ("import json,os,sys; print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), "
          "'v': os.environ['HOSTILE']}))")

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=30)
nasty = st.sampled_from(["'", '"', "$(touch /tmp/fdl-pwned)", "`id`", "a b", "\n", "\\",
                         "$HOME", "é ü 日本 🚀", "-e", "*", "!", ";", "&&", "'\\''", "\t", "%s",
                         "\r\n", "${IFS}", "|", ">x", "~"])
values = st.one_of(text, nasty, st.lists(nasty, min_size=1, max_size=5).map("".join))
dirnames = values.filter(lambda s: s not in ("", ".", "..") and "/" not in s
                         and len(s.encode()) < 200)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from fdl_fabric.testing import SshdLab

    root = tmp_path_factory.mktemp("quoting-lab")
    lab = SshdLab(root, 1).start()
    h = lab.hosts[0]
    doc = textwrap.dedent(f"""\
        workers:
          - host: lab1
            path: {json.dumps(h.path)}
            nproc: 1
            ssh: {{target: "{h.addr}", port: {h.port}, user: "{lab.user}",
                   identity_file: "{lab.identity_file}",
                   options: {json.dumps(lab.ssh_options())}}}
        """)
    cluster = parse_cluster(doc, file="q.yml", folder=str(root), local_hostname="ctl")
    transport = for_worker(cluster.workers[0], {"lab1": resolve_settings(cluster.workers[0])})
    transport.connect()
    yield cluster, transport, Path(h.path)
    transport.close()
    lab.stop()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=values, args=st.lists(values, max_size=4), dirname=dirnames)
def test_env_values_arguments_and_paths_reach_the_remote_rank_exactly(
        remote: Any, value: str, args: list[str], dirname: str) -> None:
    cluster, transport, base = remote
    workdir = base / dirname
    workdir.mkdir(exist_ok=True)
    worker = cluster.workers[0]
    import dataclasses

    worker = dataclasses.replace(worker, path=str(workdir), env={"HOSTILE": value})
    cluster = dataclasses.replace(cluster, workers=(worker,))
    plan = build_plan(cluster, argv=["python3", "-c", REPORT, *args], run_id="q",
                      salt=new_salt(), launcher_env={})
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    session = AgentSession(transport, inbox.put)
    session.start()
    session.spec(plan.agent_spec("lab1", start_now=True))
    out = b""
    seen: list[reports.Report] = []
    while True:
        report = inbox.get(timeout=30)
        seen.append(report)
        if isinstance(report, reports.Output) and not report.stderr:
            out += report.data
        if isinstance(report, reports.AgentGone):
            break
    session.join(5)
    exits = [r for r in seen if isinstance(r, reports.Exited)]
    assert exits and exits[0].code == 0, seen
    got = json.loads(out.decode().splitlines()[-1])
    assert got == {"argv": args, "cwd": str(workdir), "v": value}

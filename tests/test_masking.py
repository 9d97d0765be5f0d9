"""Secrets are found by value as well as by name (issue 34, item 4): the one rule of
`fdl_fabric.masking`, the ``secret_env`` key that feeds it, and the sinks that apply it
(the dry run's words, every JSON record of an event), checked with real-looking samples.

Every token here is fake: shaped like the real ones (prefix, length, alphabet) and
marked ``FAKE``; none was ever issued. The real launches are in test_masking_lab.py.
"""

from __future__ import annotations

import base64
import contextlib
import json
import string
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdl_fabric import masking
from fdl_fabric.clusterfile import ConfigError, parse_cluster
from fdl_fabric.events import Event, Name
from fdl_fabric.masking import (
    MASK,
    declare,
    mask_data,
    mask_env,
    mask_text,
    secret_name,
    token_shaped,
)
from fdl_fabric.planning.plan import build_plan
from fdl_fabric.presentation.dryrunwords import dry_run_text
from fdl_fabric.presentation.records import record

#: A distinctive fake password, in the issue's own example of a URL with credentials.
PASSWORD = "Zq7-fake-Pw-0x41"
DATABASE_URL = f"postgres://trainer:{PASSWORD}@db.invalid:5432/runs"


def _jwt() -> str:
    """A JSON web token's shape: two base64url JSON objects and a signature, all fake."""
    def part(obj: dict[str, str]) -> str:
        raw = json.dumps(obj, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")
    return (part({"alg": "HS256", "typ": "JWT"}) + "." + part({"sub": "fake-user"})
            + ".FAKEsig0a1B2c3D4e5F6g7H8i9J0kLmN")


#: Fake tokens, one per well-known shape.
FAKE_TOKENS = {
    "github classic": "ghp_FAKEa1B2c3D4e5F6g7H8i9J0k1L2m3N4o5",
    "github oauth": "gho_FAKEa1B2c3D4e5F6g7H8i9J0k1L2m3N4o5",
    "github fine-grained": "github_pat_11FAKE0000a1B2c3D4e5F6_g7H8i9J0k1L2m3N4o5P6q7R8s9T0u1V2w3",
    "hugging face": "hf_FAKEabcdEFGHijklMNOPqrstUVWXyzAB",
    "openai": "sk-proj-FAKE1a2B3c4D5e6F7g8H9i0J1k2L3m4N",
    "slack bot": "xoxb-000000000000-0000000000000-FAKEa1B2c3D4e5F6g7H8i9J0",
    "aws key id": "AKIAFAKEEXAMPLE00000",
    "gitlab": "glpat-FAKEa1B2c3D4e5F6g7H8",
    "jwt": _jwt(),
    "no prefix, high entropy": "Zk4Qp9sLx2Vb7Nw3Rt6Yh1Jm8Fc",
}

#: Values that must stay readable: a plan full of *** helps nobody.
ORDINARY = [
    "/home/alice/projects/fdl-fabric/examples/toy_train.py",
    "/usr/local/cuda-12.4/lib64:/usr/lib/x86_64-linux-gnu:/opt/conda/lib",
    "/data/imagenet/ILSVRC2012_img_train/n01440764/n01440764_10026.JPEG",
    "gpu-node-017.cluster.example.invalid",
    "ip-10-0-3-17.ec2.internal",
    "127.0.0.1:29500",
    "29500",
    "3.0e-4",
    "eth0,ib0",
    "^docker0,lo",
    "NCCL_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "0123456789abcdef0123456789abcdef01234567",  # a git SHA: hex only, on purpose
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",  # sha256
    "3f2b8c1e-9d4a-4b6e-8f1a-2c3d4e5f6a7b",  # a UUID
    "20260101-000001-0000abcd",  # a run id
    "meta-llama/Llama-2-7b-chat-hf",
    "nvidia/Llama-3.1-Nemotron-70B-Instruct-HF",
    "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct",
    "AutoModelForCausalLM",
    "Qwen2VLForConditionalGeneration",
    "lr3e-4_wd0.01_bs32_seed42",
    "Llama3-8B-Instruct-v2-finetune-lora-r16",
    "runs/Mar05_12-34-56_gpu-node-017",
    "expandable_segments:True,garbage_collection_threshold:0.6",
    "8.0;8.6;9.0+PTX",
    "2024-05-01T12:34:56.789Z",
    "https://example.invalid/datasets/train-00001-of-01024.tar",
    "https://mirror@example.invalid/simple",  # a user, no password
    "git@example.invalid:org/repo.git",
    "s3://my-bucket/datasets/imagenet-1k/train-00001-of-01024.tar",
    "hf_hub_enable_hf_transfer",  # a prefix, but words
    "sk-learn-intelex-2024-07",
    "python3 train.py --epochs 10 --output_dir checkpoints/run-7",
    "_ZN3c1010TensorImplD2Ev",  # a mangled C++ name, in a native stack frame
]


@contextlib.contextmanager
def declarations_of_its_own() -> Iterator[None]:
    """What a test declares stays in the test: a process keeps its declarations (that
    is the rule), and a random value declared for good would mask other tests' text."""
    kept = masking._DECLARED
    masking._DECLARED = masking._Declared()
    try:
        yield
    finally:
        masking._DECLARED = kept


@pytest.fixture
def own_declarations() -> Iterator[None]:
    with declarations_of_its_own():
        yield


# -- the rule ------------------------------------------------------------------------------

def test_a_urls_password_is_masked_and_the_rest_of_the_url_stays_readable() -> None:
    assert mask_text(DATABASE_URL) == "postgres://trainer:***@db.invalid:5432/runs"
    assert mask_text(f"DATABASE_URL={DATABASE_URL} --retry 3") == \
        "DATABASE_URL=postgres://trainer:***@db.invalid:5432/runs --retry 3"


def test_a_password_holding_an_at_sign_or_a_colon_is_masked_whole() -> None:
    assert mask_text("redis://:p@ss:w0rd@cache.invalid:6379/0") == \
        "redis://:***@cache.invalid:6379/0"
    assert mask_text("amqp://guest:hunter2@queue.invalid/vhost") == \
        "amqp://guest:***@queue.invalid/vhost"


@pytest.mark.parametrize("kind", sorted(FAKE_TOKENS))
def test_token_shaped_values_are_masked_alone_and_inside_text(kind: str) -> None:
    token = FAKE_TOKENS[kind]
    assert mask_text(token) == MASK
    for text in (f"Bearer {token}", f"--token={token}", f"'{token}'",
                 f"https://x-access-token:{token}@git.invalid/org/repo.git"):
        assert token not in mask_text(text), text


@pytest.mark.parametrize("value", ORDINARY)
def test_ordinary_values_stay_readable(value: str) -> None:
    assert mask_text(value) == value
    assert mask_env({"SOME_SETTING": value}) == {"SOME_SETTING": value}


def test_hex_only_strings_are_not_tokens_by_their_text_but_are_by_their_name() -> None:
    """The documented choice: a 40-hex git SHA is high-entropy, and training runs name
    commits by them; a hex secret (a W&B key) is caught by its name."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert not token_shaped(sha)
    assert mask_env({"GIT_COMMIT": sha, "WANDB_API_KEY": sha}) == {
        "GIT_COMMIT": sha, "WANDB_API_KEY": MASK}


def test_secret_names_mask_the_whole_value_but_the_launchers_own_ids_stay() -> None:
    for name in ("API_SECRET", "HF_TOKEN", "DB_PASSWORD", "WANDB_API_KEY", "GCP_CREDENTIALS",
                 "SESSION_COOKIE", "PRIVATE_KEY_PEM", "BASIC_AUTH"):
        assert secret_name(name), name
    for name in ("NCCL_SOCKET_IFNAME", "MASTER_ADDR", "FLODL_INTERNAL_CLUSTER_KEY", "LR"):
        assert not secret_name(name), name
    assert mask_env({"HF_TOKEN": "short", "LR": "0.1"}) == {"HF_TOKEN": MASK, "LR": "0.1"}


def test_declared_names_mask_their_values_and_long_values_are_masked_anywhere(
        own_declarations: None) -> None:
    """``secret_env``: what the rule cannot see is declared; a value of 6 characters or
    more is masked wherever it appears, a shorter one only under its name."""
    declare(["TEST_MASKING_PASSPHRASE", "TEST_MASKING_DB_*"],
            ["correct horse battery staple", "abc"])
    assert mask_env({"TEST_MASKING_PASSPHRASE": "abc", "TEST_MASKING_DB_USER": "x",
                     "OTHER": "no"}) == {"TEST_MASKING_PASSPHRASE": MASK,
                                         "TEST_MASKING_DB_USER": MASK, "OTHER": "no"}
    assert mask_text("echo 'correct horse battery staple' | login") == "echo '***' | login"
    assert mask_text("abc def") == "abc def"


def test_masking_data_masks_env_mappings_by_name_and_every_string_by_value() -> None:
    data = {"env": {"HF_TOKEN": "plain", "DATABASE_URL": DATABASE_URL, "LR": "0.1"},
            "argv": ["train.py", "--hub-token", FAKE_TOKENS["hugging face"]],
            "key": "0a1b2c3d4e5f6a7b", "count": 3, "nested": [{"error": DATABASE_URL}]}
    shown = mask_data(data)
    assert shown["env"] == {"HF_TOKEN": MASK, "LR": "0.1",
                            "DATABASE_URL": "postgres://trainer:***@db.invalid:5432/runs"}
    assert shown["argv"] == ["train.py", "--hub-token", MASK]
    assert shown["key"] == "0a1b2c3d4e5f6a7b" and shown["count"] == 3  # keys are not envs
    assert PASSWORD not in json.dumps(shown)
    assert data["env"]["DATABASE_URL"] == DATABASE_URL  # the original is untouched


def test_masked_data_is_masked_once_until_a_new_secret_is_declared(
        own_declarations: None) -> None:
    """The run's record masks an event once; its words and its JSON line keep that copy
    (issue 35: the repeats were a third of a rank's record). A value declared secret
    afterwards still reaches it."""
    data = {"argv": ["train.py", "--db", DATABASE_URL], "note": "a pass phrase kept"}
    shown = mask_data(data)
    assert mask_data(shown) is shown and PASSWORD not in json.dumps(shown)
    event = Event(Name.DRY_RUN, data=_dry_run_facts({"DATABASE_URL": DATABASE_URL}))
    assert record(Event(event.name, data=mask_data(event.data), time=event.time)) == \
        record(event)
    declare([], ["a pass phrase kept"])
    again = mask_data(shown)
    assert again is not shown and again["note"] == MASK and mask_data(again) is again


def test_an_environment_shown_before_a_declaration_is_masked_after_it(
        own_declarations: None) -> None:
    """Each (name, value) pair's verdict is remembered (8,192 ranks share most of their
    pairs), but only until something more is declared secret."""
    env = {"RUN_NOTE": "a pass phrase kept", "RANK": "3", "DATABASE_URL": DATABASE_URL}
    first = mask_env(env)
    assert first["RUN_NOTE"] == "a pass phrase kept" and PASSWORD not in first["DATABASE_URL"]
    assert mask_env(env) == first
    declare([], ["a pass phrase kept"])
    assert mask_env(env)["RUN_NOTE"] == MASK
    declare(["RANK"], [])
    assert mask_env(env) == {"RUN_NOTE": MASK, "RANK": MASK,
                             "DATABASE_URL": first["DATABASE_URL"]}


@pytest.mark.parametrize("repeat", [60, 5000])  # a long command line; one past the table
def test_a_long_command_line_is_masked_each_time_it_is_shown(
        own_declarations: None, repeat: int) -> None:
    """A rank's command line is shown once per rank: a long one is remembered too (up
    to `MASK_CACHE_LONG_TEXT_MAX`), and a value declared later still reaches it."""
    line = "python3 -c 'import os; " + "x = 1; " * repeat + f"connect({DATABASE_URL!r})'"
    assert len(line) > masking.MASK_CACHE_TEXT_MAX
    shown = mask_text(line)
    assert PASSWORD not in shown and "import os" in shown and mask_text(line) == shown
    declare([], ["import os"])
    assert "import os" not in mask_text(line)


# -- properties: a masked rendering never contains the secret ------------------------------

_LOWER = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=12)
_PASSWORD_CHARS = string.ascii_letters + string.digits + "!$%&'()+,;=:@-._~"


@settings(max_examples=300, deadline=None)
@given(scheme=st.sampled_from(["postgres", "postgresql", "mysql", "redis", "amqp", "https",
                               "mongodb+srv", "s3"]),
       user=st.text(alphabet=string.ascii_lowercase, max_size=8), host=_LOWER, path=_LOWER,
       password=st.text(alphabet=_PASSWORD_CHARS, min_size=1, max_size=40).filter(
           lambda p: any(c in string.ascii_uppercase + string.digits for c in p)),
       left=st.text(alphabet=string.ascii_lowercase + " =", max_size=10),
       right=st.text(alphabet=string.ascii_lowercase + " ", max_size=10))
def test_a_urls_password_never_survives_masking(scheme: str, user: str, host: str, path: str,
                                                password: str, left: str,
                                                right: str) -> None:
    """Only the password has capitals or digits (beside the scheme's own: the 3 of s3), so
    any trace of it would show."""
    url = f"{scheme}://{user}:{password}@{host}.invalid/{path}"
    shown = mask_text(f"{left} {url} {right}")
    assert password not in shown.replace(f"{scheme}://", "://")
    assert f"{scheme}://{user}:***@{host}.invalid/{path}" in shown


_BASE62 = string.ascii_letters + string.digits


@settings(max_examples=300, deadline=None)
@given(prefix=st.sampled_from(["ghp_", "gho_", "ghs_", "github_pat_", "hf_", "sk-", "sk-proj-",
                               "xoxb-", "xoxp-", "glpat-", "npm_", "pypi-"]),
       tail=st.text(alphabet=_BASE62, min_size=16, max_size=80).filter(
           lambda t: sum(any(f(c) for c in t)
                         for f in (str.islower, str.isupper, str.isdigit)) >= 2),
       left=st.text(max_size=20), right=st.text(max_size=20))
def test_a_prefixed_token_never_survives_masking(prefix: str, tail: str, left: str,
                                                 right: str) -> None:
    token = prefix + tail
    shown = mask_text(f"{left} {token} {right}")
    assert token not in shown
    if tail not in left and tail not in right:
        assert tail not in shown


@settings(max_examples=200, deadline=None)
@given(value=st.text(min_size=6, max_size=40).filter(
           lambda v: len(v.strip()) >= 6 and "*" not in v),
       left=st.text(max_size=30), right=st.text(max_size=30))
def test_a_declared_value_never_survives_masking(value: str, left: str, right: str) -> None:
    """(A value made of the mask's own stars is left out: another rule's ``***`` could
    complete it again.)"""
    with declarations_of_its_own():
        declare([], [value])
        assert value not in mask_text(left + value + right + value)


@settings(max_examples=100, deadline=None)
@given(secret=st.sampled_from(sorted(FAKE_TOKENS.values()) + [DATABASE_URL]),
       names=st.lists(st.from_regex(r"[A-Z][A-Z0-9_]{0,10}", fullmatch=True), min_size=1,
                      max_size=4, unique=True),
       where=st.integers(min_value=0, max_value=3))
def test_a_dry_runs_words_and_records_never_show_a_secret(secret: str, names: list[str],
                                                          where: int) -> None:
    """Wherever the secret sits in a dry run's facts (shared env, a rank's env, argv,
    cwd), neither its words nor its JSON record (``--json``, events.jsonl) shows it."""
    env = {n: "1" for n in names}
    facts = _dry_run_facts(env)
    host = facts["hosts"][0]
    [lambda: host["env"].update({names[0]: secret}),
     lambda: host["ranks"][0]["env"].update({names[0]: secret}),
     lambda: host["argv"].append(secret),
     lambda: host.update(cwd=f"/srv/{secret}")][where]()
    words = dry_run_text(facts)
    kept = json.dumps(record(Event(Name.DRY_RUN, data=facts)), ensure_ascii=False)
    hidden = PASSWORD if secret == DATABASE_URL else secret
    assert hidden not in words and hidden not in kept


def _dry_run_facts(env: dict[str, str]) -> dict[str, Any]:
    """The facts `commands.dryrun.dry_run_data` gathers, for one host of two ranks."""
    return {"file": "cluster.yml", "world_size": 2, "controller": "127.0.0.1", "port": 1337,
            "bind": "127.0.0.1", "kill_grace": 10.0, "master_port": 29500,
            "tree": {"fanout": 64, "gateways": {}},
            "hosts": [{"host": "localhost", "how": "local", "all_devices": False,
                       "cwd": "/srv/project", "argv": ["python3", "train.py"], "env": dict(env),
                       "ranks": [{"rank": 0, "env": {"RANK": "0"}, "device": None},
                                 {"rank": 1, "env": {"RANK": "1"}, "device": None}]}]}


# -- the sinks -----------------------------------------------------------------------------

def test_a_dry_runs_words_mask_by_name_by_value_and_by_secret_env(
        own_declarations: None) -> None:
    declare(["TEST_MASKING_SHORT"], [])
    facts = _dry_run_facts({"DATABASE_URL": DATABASE_URL, "HF_TOKEN": "x",
                            "UPLOAD_BEARER": FAKE_TOKENS["no prefix, high entropy"],
                            "TEST_MASKING_SHORT": "pin42", "NCCL_SOCKET_IFNAME": "eth0"})
    text = dry_run_text(facts)
    assert "DATABASE_URL='postgres://trainer:***@db.invalid:5432/runs'" in text
    assert "HF_TOKEN='***'" in text and "UPLOAD_BEARER='***'" in text
    assert "TEST_MASKING_SHORT='***'" in text and "pin42" not in text
    assert "NCCL_SOCKET_IFNAME=eth0" in text


def test_a_json_record_masks_its_data_and_its_words() -> None:
    event = Event(Name.DRY_RUN, data=_dry_run_facts({"DATABASE_URL": DATABASE_URL}))
    kept = record(event)
    assert PASSWORD not in json.dumps(kept) and PASSWORD not in kept["message"]
    assert kept["data"]["hosts"][0]["env"]["DATABASE_URL"] == \
        "postgres://trainer:***@db.invalid:5432/runs"
    assert event.data["hosts"][0]["env"]["DATABASE_URL"] == DATABASE_URL  # not mutated


def test_rank_output_records_are_the_ranks_own_bytes() -> None:
    """A rank's output is kept as it printed it (its log files have the same bytes)."""
    line = f"connecting to {DATABASE_URL}\n"
    kept = record(Event(Name.RANK_OUTPUT, host="localhost", rank=0,
                        data={"text": line, "stderr": False}))
    assert kept["data"]["text"] == line and kept["message"] is None


# -- secret_env in the cluster file, and the plan ------------------------------------------

def _cluster(text: str) -> Any:
    return parse_cluster(textwrap.dedent(text).lstrip("\n"), file="cluster.yml",
                         folder="/proj", local_hostname="ctl")


def test_secret_env_is_a_list_of_names_or_globs_kept_with_the_cluster(
        own_declarations: None) -> None:
    cluster = _cluster("""
        secret_env: [TEST_MASKING_APP_PASSPHRASE, "TEST_MASKING_VAULT_*"]
        env: {TEST_MASKING_APP_PASSPHRASE: "grey tabby on the keyboard"}
        workers: [{host: ctl, nproc: 1}]
        """)
    assert cluster.secret_env == ("TEST_MASKING_APP_PASSPHRASE", "TEST_MASKING_VAULT_*")
    assert secret_name("TEST_MASKING_VAULT_ROLE")
    # Declared as soon as the file is read: the run's record opens before its plan.
    assert mask_text("login 'grey tabby on the keyboard'") == "login '***'"


def test_a_file_without_secret_env_declares_nothing() -> None:
    assert _cluster("workers: [{host: ctl, nproc: 1}]").secret_env == ()


@pytest.mark.parametrize("value,message", [
    ("DATABASE_URL", "expected a list of variable names or globs"),
    ("[1]", "expected a string"),
    ("[\"DB URL\"]", "expected a variable name or a glob of one"),
    ("{DATABASE_URL: true}", "expected a list of variable names or globs"),
])
def test_a_bad_secret_env_is_refused_naming_the_file_the_key_and_the_line(
        value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _cluster(f"""
            workers: [{{host: ctl, nproc: 1}}]
            secret_env: {value}
            """)
    (problem,) = info.value.problems
    assert problem.key.startswith("secret_env") and problem.line == 2, problem
    assert message in str(problem) and str(problem).startswith("cluster.yml:2: secret_env")
    assert info.value.exit_code == 2


def test_the_agents_spec_carries_the_real_values_that_every_view_masks(
        own_declarations: None) -> None:
    token = FAKE_TOKENS["github classic"]
    cluster = _cluster(f"""
        secret_env: [TEST_MASKING_FORWARDED]
        env_forward: [TEST_MASKING_FORWARDED]
        env: {{DATABASE_URL: "{DATABASE_URL}", MIRROR_GH: {token}}}
        workers: [{{host: ctl, nproc: 2}}]
        """)
    plan = build_plan(cluster, argv=["python3", "train.py"], run_id="run1",
                      salt=bytes(16), launcher_env={"TEST_MASKING_FORWARDED": "pin-8812-x"})
    spec = plan.agent_spec("ctl")
    assert spec["env"]["DATABASE_URL"] == DATABASE_URL and spec["env"]["MIRROR_GH"] == token
    assert spec["env"]["TEST_MASKING_FORWARDED"] == "pin-8812-x"
    shown = json.dumps(mask_data(spec))
    for secret in (PASSWORD, token, "pin-8812-x"):
        assert secret not in shown
    # The launcher's forwarded value is declared by the plan: masked in any text now.
    assert mask_text("retry with pin-8812-x") == "retry with ***"


def test_a_host_keys_fingerprint_is_public_and_stays_readable() -> None:
    line = ("host key for [127.0.0.1]:2222 CHANGED: "
            "SHA256:nThbg6kXUpJWGl7E1IGOCspRomTxdCARLviKw6E5SY8 is not the one recorded")
    assert masking.mask_text(line) == line


def test_a_launcher_line_quoting_a_url_with_its_password_shows_it_masked() -> None:
    from fdl_fabric.events import Name, event
    from fdl_fabric.presentation.words import render

    line = render(event(Name.REFUSED, error="cannot reach postgres://trainer:"
                        "Xq7-not-real-pw@db.invalid:5432/runs (connection refused)"))
    assert "Xq7-not-real-pw" not in line and "postgres://trainer:***@db.invalid" in line


def test_a_synced_tree_path_stays_readable_while_a_token_in_a_path_is_masked() -> None:
    tree = "/tmp/tmp3k2jd9fq/lab/hosts/lab1/.fdl-code/trees/a3f9c0d2e1b4c5d6e7f8"
    assert masking.mask_text(tree) == tree
    assert "Zk4Qp9sLx2Vb7Nw3Rt6Yh1Jm" not in masking.mask_text(
        "/var/run/secrets/Zk4Qp9sLx2Vb7Nw3Rt6Yh1Jm/token")


def test_a_dirty_trees_code_id_stays_readable() -> None:
    assert masking.mask_text("git:1a2b3c4d5e6f+0a1b2c3d") == "git:1a2b3c4d5e6f+0a1b2c3d"

"""Envelopes: hex JSON that round-trips, and the prebuild map."""

from __future__ import annotations

import pytest

from fdl_fabric.planning.envelope import (
    EnvelopeError,
    PrebuiltBinary,
    SlimEnvelope,
    decode_hex,
    encode_hex,
    new_run_id,
    new_salt,
    parse_prebuilt,
)


def _envelope(**kw: object) -> SlimEnvelope:
    base: dict[str, object] = dict(
        run_id="r1", controller_host="10.0.0.1", controller_port=1337, world_size=4,
        num_workers=2, host="b", ranks=(2, 3), local_devices=(0, 1),
        nccl_socket_ifname="eth0", path="/srv/x", salt=bytes(range(16)))
    base.update(kw)
    return SlimEnvelope(**base)  # type: ignore[arg-type]


def test_slim_envelope_round_trips_through_hex() -> None:
    env = _envelope()
    assert SlimEnvelope.from_hex(env.to_hex()) == env


def test_salt_travels_as_32_lowercase_hex_chars() -> None:
    data = decode_hex(_envelope().to_hex())
    assert data["salt"] == bytes(range(16)).hex() and len(data["salt"]) == 32


def test_envelope_carries_worker_and_controller_as_dialled_and_no_ssh() -> None:
    data = decode_hex(_envelope(controller_host="127.0.0.1").to_hex())
    assert data["controller"] == {"host": "127.0.0.1", "port": 1337}
    assert data["worker"]["ranks"] == [2, 3] and data["worker"]["local_devices"] == [0, 1]
    assert data["world_size"] == 4 and data["num_workers"] == 2
    assert "ssh" not in data["worker"]


def test_cpu_worker_has_no_device_list() -> None:
    assert decode_hex(_envelope(local_devices=None).to_hex())["worker"]["local_devices"] is None


def test_ranks_outside_the_world_are_refused() -> None:
    with pytest.raises(EnvelopeError, match="ranks"):
        _envelope(ranks=(3, 4))


def test_hex_decoding_accepts_upper_case_and_rejects_odd_length() -> None:
    text = encode_hex({"a": 1})
    assert decode_hex(text.upper()) == {"a": 1}
    with pytest.raises(EnvelopeError):
        decode_hex(text[:-1])


def test_salts_and_run_ids_are_fresh() -> None:
    assert new_salt() != new_salt() and len(new_salt()) == 16
    assert new_run_id() != new_run_id()


def test_prebuild_unset_or_blank_means_none() -> None:
    assert parse_prebuilt(None) == {} and parse_prebuilt("  ") == {}


def test_prebuild_entry_gives_binary_and_cwd() -> None:
    entries = parse_prebuilt('{"b": {"bin": "target/x", "ld_library_path": "/lt/lib", '
                             '"cwd_subpath": "sub"}}')
    assert entries == {"b": PrebuiltBinary("target/x", "/lt/lib", "sub")}
    assert entries["b"].program("/srv/p/") == "/srv/p/target/x"
    assert entries["b"].cwd("/srv/p") == "/srv/p/sub"


@pytest.mark.parametrize("raw,match", [
    ("{not json", "parse FLODL_INTERNAL_PREBUILD_PER_HOST JSON"),
    ('["a"]', "keyed by host"),
    ('{"h": {"ld_library_path": "/x"}}', "bin"),
    ('{"h": {"bin": "x", "oops": 1}}', "unknown keys"),
])
def test_bad_prebuild_json_is_a_loud_error(raw: str, match: str) -> None:
    with pytest.raises(EnvelopeError, match=match):
        parse_prebuilt(raw)

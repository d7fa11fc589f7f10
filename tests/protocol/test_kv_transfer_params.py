"""vLLM's `kv_transfer_params` as PrfaaS writes (gateway) and reads (connector) them."""

from __future__ import annotations

import pytest

from prfaas.protocol.kv_transfer import (
    PrefixPull,
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
    parse_prefix_pull,
)


def test_each_side_round_trips_through_its_json() -> None:
    """What the gateway sends each engine parses back to the same side and fields."""
    decode_side = RemotePrefill("10.0.0.5", 8998, 2**64 - 1)
    assert parse_kv_transfer_params(decode_side.to_json()) == decode_side
    assert parse_kv_transfer_params(RemoteDecode(7).to_json()) == RemoteDecode(7)
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({"do_remote_prefill": False}) is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"do_remote_prefill": True, "remote_host": "h", "room": 1}, "lacks 'remote_port'"),
        ({"do_remote_decode": True, "room": "1"}, "expected an integer, got '1'"),
        ({"do_remote_decode": True, "room": -1}, "room must be in 0..2\\*\\*64-1, got -1"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 0, "room": 1},
         "remote_port must be a port, got 0"),
    ],
)  # fmt: skip
def test_bad_params_name_the_field(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_params(params)


def test_a_prefix_pull_round_trips_beside_the_prefill_side() -> None:
    """`prefix_pull` travels beside `do_remote_decode` (a prefill that pulls first) or alone."""
    pull = PrefixPull("10.0.0.6", 8999, 5, 768)
    params = {**RemoteDecode(7).to_json(), **pull.to_json()}
    assert parse_prefix_pull(params) == pull
    assert parse_kv_transfer_params(params) == RemoteDecode(7)
    assert parse_prefix_pull(RemoteDecode(7).to_json()) is None
    assert parse_prefix_pull(None) is None


@pytest.mark.parametrize(
    ("pull", "message"),
    [
        ({"host": "h", "port": 1, "room": 1}, "lacks 'tokens'"),
        ({"host": "h", "port": 1, "room": 1, "tokens": 0}, "tokens must be > 0"),
        ({"host": "h", "port": 70000, "room": 1, "tokens": 8}, "remote_port must be a port"),
        ([1, 2], "prefix_pull must be"),
    ],
)
def test_a_bad_prefix_pull_names_the_field(pull: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_prefix_pull({"prefix_pull": pull})

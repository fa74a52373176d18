"""A client with a token presents it only to the side channels ``trusted_side_channels``
names (kvbridge/trust.py): real side channels and a rogue one on loopback, which records
every ``Authorization`` header it receives."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.config import SideChannelConfig
from kvbridge.errors import ConfigError, UntrustedSideChannel
from kvbridge.handshake import HandshakeServer, make_client, make_server
from kvbridge.trust import SideChannelTrust, parse_trusted
from tests.helpers import RogueSideChannel, compat, full_store

HOST = "127.0.0.1"
TOKEN = "decode-secret"


def _config(method: str, trusted: str | None) -> SideChannelConfig:
    return SideChannelConfig.load({"handshake_method": method, "token": TOKEN,
                                   "side_channel_port": 0, "handshake_timeout": 5,
                                   "side_channel_isolation": "thread",
                                   "trusted_side_channels": trusted}, environ={})


@pytest.fixture(params=["http", "zmq"])
def server(request: pytest.FixtureRequest) -> Iterator[HandshakeServer]:
    s = make_server(_config(request.param, None), full_store(1))
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def rogue() -> Iterator[RogueSideChannel]:
    with RogueSideChannel() as r:
        yield r


def test_the_token_goes_to_a_trusted_side_channel_and_to_no_other(server, rogue):
    client = make_client(_config(server.method, f"{HOST}:{server.port}"), compat())
    try:
        assert len(client.fetch(HOST, server.port)) == 1
        with pytest.raises(UntrustedSideChannel, match="trusted_side_channels"):
            client.fetch(HOST, rogue.port)
    finally:
        client.close()
    assert rogue.connections == 0 and rogue.authorizations == []


@pytest.mark.parametrize("method", ["http", "zmq"])
def test_unset_trusts_no_side_channel_with_the_token(method, rogue):
    client = make_client(_config(method, None), compat())
    try:
        with pytest.raises(UntrustedSideChannel):
            client.fetch(HOST, rogue.port)
    finally:
        client.close()
    assert rogue.connections == 0


def test_star_trusts_every_side_channel(rogue):
    """The explicit opt-out: the token goes wherever a request names."""
    client = make_client(_config("http", "*"), compat())
    try:
        with pytest.raises(Exception):  # noqa: B017 - the rogue answers 404
            client.fetch(HOST, rogue.port)
    finally:
        client.close()
    assert rogue.authorizations == [f"Bearer {TOKEN}"]


def test_a_keep_warm_request_carries_no_token(rogue):
    """``warm`` takes any host (it reads no metadata): the liveness route needs no token."""
    client = make_client(_config("http", "*"), compat(), keep_warm=True)
    try:
        assert client.warm(HOST, rogue.port) is False  # the rogue answers 404
    finally:
        client.close()
    assert rogue.connections == 1 and rogue.authorizations == []


@pytest.mark.parametrize(("patterns", "host", "port", "allowed"), [
    ("prefill-*.kv.internal", "prefill-a.kv.internal", 5600, True),
    ("prefill-*.kv.internal", "prefill-a.attacker.example", 5600, False),
    ("prefill-*.kv.internal", "prefill-a.kv.internal.attacker.example", 5600, False),
    ("10.0.0.5:5600", "10.0.0.5", 5600, True),
    ("10.0.0.5:5600", "10.0.0.5", 5601, False),
    ("10.0.*.*:5600", "10.0.3.4", 5600, True),
    ("10.0.*.*:5600", "10.1.3.4", 5600, False),
    ("[fd00::1]:5600", "[fd00::1]", 5600, True),
    ("[fd00::1]:5600", "fd00::1", 5600, True),
    ("fd00::1", "fd00::1", 1, True),
    ("Prefill.KV.internal", "prefill.kv.INTERNAL", 1, True),
    ("*", "anything.example", 1, True),
    ("*:5600", "anything.example", 5601, False),
])
def test_patterns(patterns, host, port, allowed):
    assert SideChannelTrust.parse(patterns).allows(host, port) is allowed


@pytest.mark.parametrize("bad", ["a:0", "a:65536", "a:x", "[::1", "[::1]5600", "a b",
                                 "a/b", "user@host", ",", "x!"])
def test_a_malformed_pattern_is_a_config_error_naming_the_setting(bad):
    with pytest.raises(ConfigError, match="trusted_side_channels"):
        _config("http", bad)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(max_size=60), st.text(max_size=30), st.integers(0, 70000))
def test_fuzzed_patterns_parse_or_are_refused_and_never_raise_when_matched(text, host, port):
    try:
        parse_trusted(text)
    except ValueError:
        return
    assert isinstance(SideChannelTrust.parse(text).allows(host, port), bool)

"""Side-channel settings: sources and their precedence, validation, secrets."""

from __future__ import annotations

import os
import ssl

import pytest

from kvbridge.config import SideChannelConfig
from kvbridge.errors import ConfigError

TOKEN = "tok-3f9a1c7e-secret"


def load(flags=None, **env) -> SideChannelConfig:
    return SideChannelConfig.load(flags, environ=env)


def test_defaults():
    c = load()
    assert c.handshake_method == "zmq"
    assert c.handshake_timeout == 10.0
    assert c.side_channel_host == "127.0.0.1"
    assert c.side_channel_port == 5600
    assert c.advertised == "127.0.0.1"
    assert c.token is None and not c.tls.enabled
    assert c.ssl_cert_reqs == ssl.CERT_NONE


def test_load_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_HANDSHAKE_METHOD", "http")
    assert SideChannelConfig.load().handshake_method == "http"


def test_kvbridge_environment():
    c = load(KVBRIDGE_HANDSHAKE_METHOD="HTTP", KVBRIDGE_HANDSHAKE_TIMEOUT="2.5",
             KVBRIDGE_SIDE_CHANNEL_HOST="10.1.2.3", KVBRIDGE_SIDE_CHANNEL_PORT="7001",
             KVBRIDGE_ADVERTISE_HOST="node-a", KVBRIDGE_MAX_MESSAGE_BYTES="1024",
             KVBRIDGE_SSL_CERT_REQS="CERT_REQUIRED", KVBRIDGE_SSL_CA_CERTS="/x/ca.pem",
             KVBRIDGE_SSL_CERTFILE="/x/server.pem")
    assert (c.handshake_method, c.handshake_timeout, c.side_channel_host, c.side_channel_port,
            c.advertised, c.max_message_bytes) == ("http", 2.5, "10.1.2.3", 7001, "node-a", 1024)
    assert c.ssl_cert_reqs == ssl.CERT_REQUIRED


def test_client_certificates_required_without_a_server_certificate_is_refused():
    """uvicorn would then serve plaintext with no client check at all."""
    with pytest.raises(ConfigError, match="TLS would be off"):
        load(KVBRIDGE_SSL_CERT_REQS="required", KVBRIDGE_SSL_CA_CERTS="/x/ca.pem")


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_timeout_must_be_finite_and_positive(value):
    with pytest.raises(ConfigError, match=f"KVBRIDGE_HANDSHAKE_TIMEOUT='{value}'"):
        load(KVBRIDGE_HANDSHAKE_TIMEOUT=value)


def test_vllm_aliases():
    c = load(VLLM_NIXL_HANDSHAKE_METHOD="http", VLLM_NIXL_HANDSHAKE_TIMEOUT="3",
             VLLM_NIXL_SIDE_CHANNEL_HOST="10.0.0.7", VLLM_NIXL_SIDE_CHANNEL_PORT="5601")
    assert (c.handshake_method, c.handshake_timeout, c.side_channel_host,
            c.side_channel_port) == ("http", 3.0, "10.0.0.7", 5601)


def test_ours_win_over_the_alias():
    c = load(KVBRIDGE_HANDSHAKE_METHOD="zmq", VLLM_NIXL_HANDSHAKE_METHOD="http",
             KVBRIDGE_HANDSHAKE_TIMEOUT="4", VLLM_NIXL_HANDSHAKE_TIMEOUT="9",
             KVBRIDGE_SIDE_CHANNEL_HOST="10.0.0.1", VLLM_NIXL_SIDE_CHANNEL_HOST="10.0.0.2",
             KVBRIDGE_SIDE_CHANNEL_PORT="6000", VLLM_NIXL_SIDE_CHANNEL_PORT="6001")
    assert (c.handshake_method, c.handshake_timeout, c.side_channel_host,
            c.side_channel_port) == ("zmq", 4.0, "10.0.0.1", 6000)


def test_empty_environment_value_falls_through_to_the_alias():
    assert load(KVBRIDGE_HANDSHAKE_METHOD="",
                VLLM_NIXL_HANDSHAKE_METHOD="http").handshake_method == "http"


def test_flags_win_over_environment():
    c = load({"handshake_method": "http", "side_channel_port": 7100, "handshake_timeout": 1,
              "side_channel_host": None},
             KVBRIDGE_HANDSHAKE_METHOD="zmq", VLLM_NIXL_SIDE_CHANNEL_PORT="5601",
             KVBRIDGE_HANDSHAKE_TIMEOUT="8", KVBRIDGE_SIDE_CHANNEL_HOST="10.9.9.9")
    assert (c.handshake_method, c.side_channel_port, c.handshake_timeout) == ("http", 7100, 1.0)
    assert c.side_channel_host == "10.9.9.9"  # a None flag is "not given"


@pytest.mark.parametrize("env", [
    {"KVBRIDGE_HANDSHAKE_METHOD": "grpc"},
    {"VLLM_NIXL_HANDSHAKE_METHOD": "tcp"},
    {"KVBRIDGE_HANDSHAKE_TIMEOUT": "soon"},
    {"KVBRIDGE_HANDSHAKE_TIMEOUT": "0"},
    {"VLLM_NIXL_HANDSHAKE_TIMEOUT": "-1"},
    {"KVBRIDGE_HANDSHAKE_TIMEOUT": "nan"},
    {"KVBRIDGE_SIDE_CHANNEL_PORT": "http"},
    {"KVBRIDGE_SIDE_CHANNEL_PORT": "65536"},
    {"VLLM_NIXL_SIDE_CHANNEL_PORT": "-1"},
    {"KVBRIDGE_SIDE_CHANNEL_PORT": "56.5"},
    {"KVBRIDGE_SSL_CERT_REQS": "maybe"},
])
def test_bad_values(env):
    with pytest.raises(ConfigError):
        load(**env)


def test_bad_method_message_lists_the_choices():
    with pytest.raises(ConfigError, match=r"'grpc'.*zmq.*http"):
        load({"handshake_method": "grpc"})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_advertising_a_wildcard_is_refused(host):
    with pytest.raises(ConfigError, match="(?i)advertise") as ei:
        load(KVBRIDGE_SIDE_CHANNEL_HOST=host)
    assert host.strip("[]") in str(ei.value)
    with pytest.raises(ConfigError, match="(?i)advertise"):
        load(KVBRIDGE_SIDE_CHANNEL_HOST="10.0.0.1", KVBRIDGE_ADVERTISE_HOST=host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_binding_a_wildcard_with_an_advertise_host(host):
    c = load({"side_channel_host": host, "advertise_host": "prefill-0.svc"})
    assert c.side_channel_host == host and c.advertised == "prefill-0.svc"


def test_tls_key_without_cert(tmp_path):
    with pytest.raises(ConfigError, match="key given without a certificate"):
        load(KVBRIDGE_SSL_KEYFILE=str(tmp_path / "k.pem"))


@pytest.mark.parametrize("value,mode", [("none", ssl.CERT_NONE), ("OPTIONAL", ssl.CERT_OPTIONAL),
                                        ("cert_required", ssl.CERT_REQUIRED), ("1", 1), (2, 2)])
def test_cert_reqs_values(value, mode):
    assert load({"ssl_cert_reqs": value, "ssl_ca_certs": "/x/ca.pem",
                 "ssl_certfile": "/x/server.pem"}).ssl_cert_reqs == mode


@pytest.mark.parametrize("value", [5, -1, True])
def test_cert_reqs_out_of_range(value):
    with pytest.raises(ConfigError, match="ssl_cert_reqs"):
        load({"ssl_cert_reqs": value, "ssl_ca_certs": "/x/ca.pem"})


def test_client_certs_required_without_ca():
    with pytest.raises(ConfigError, match="ssl_ca_certs"):
        load({"ssl_cert_reqs": "required", "ssl_certfile": "/x/server.pem"})


def test_tls_settings(certs):
    c = load({"ssl_certfile": str(certs / "prefill.pem"), "ssl_keyfile": str(certs / "prefill.key"),
              "ssl_ca_certs": str(certs / "ca.pem"), "ssl_cert_reqs": "2"})
    assert c.tls.enabled and c.tls.cert_reqs == ssl.CERT_REQUIRED
    assert c.tls.client_context().verify_mode == ssl.CERT_REQUIRED  # the server is verified


def _token_file(tmp_path, text: str, mode: int):
    p = tmp_path / "token"
    p.write_text(text)
    os.chmod(p, mode)
    return str(p)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_token_file_readable_by_others_refused(tmp_path, mode):
    path = _token_file(tmp_path, TOKEN, mode)
    with pytest.raises(ConfigError, match="chmod 600") as ei:
        load(KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE=path)
    assert TOKEN not in str(ei.value)


def test_token_file_600_accepted(tmp_path):
    path = _token_file(tmp_path, f"  {TOKEN}\n", 0o600)
    c = load(KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE=path)
    assert c.token == TOKEN and c.token_file == path
    assert load({"token_file": path}).token == TOKEN


@pytest.mark.parametrize("text", ["", " \n\t\n"])
def test_empty_token_file_refused(tmp_path, text):
    with pytest.raises(ConfigError, match="empty"):
        load(KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE=_token_file(tmp_path, text, 0o600))


def test_missing_token_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read token file"):
        load(KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE=str(tmp_path / "nope"))


def test_token_and_token_file_both_refused(tmp_path):
    path = _token_file(tmp_path, TOKEN, 0o600)
    with pytest.raises(ConfigError, match="not both"):
        load(KVBRIDGE_SIDE_CHANNEL_TOKEN=TOKEN, KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE=path)
    with pytest.raises(ConfigError, match="not both"):
        load({"token": TOKEN}, KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE=path)


def test_describe_never_shows_the_token(tmp_path):
    inline = load(KVBRIDGE_SIDE_CHANNEL_TOKEN=TOKEN)
    from_file = load(KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE=_token_file(tmp_path, TOKEN, 0o600))
    for c in (inline, from_file):
        assert c.token == TOKEN
        text = "\n".join(c.describe())
        assert TOKEN not in text
        assert "token=<set>" in c.describe()
    assert "token=None" in load().describe()
    # everything else is described
    names = {line.split("=", 1)[0] for line in inline.describe()}
    assert {"handshake_method", "side_channel_port", "ssl_cert_reqs", "token_file"} <= names
    assert "ssl_cert_reqs=CERT_NONE" in inline.describe()

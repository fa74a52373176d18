"""Fuzz the trust layer's parsers: ``tokens_file`` text and bytes, and certificate names
(``getpeercert()`` shapes, then real certificates against a real mutual-TLS side
channel). Never an unexpected exception: a token set, a ``ConfigError``, or a refusal
(401/403), never a 500. A small budget: seconds, for the fast loop."""

from __future__ import annotations

import ipaddress
import os
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID, ObjectIdentifier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.config import SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.handshake import make_server
from kvbridge.handshake.authz import Authorizer, PeerAllowList, TokenSet, cert_identities
from kvbridge.tokens import TOKEN_SCOPES, NamedToken, parse_tokens
from kvbridge.tools.testing.certs import issue, issue_with_names, new_ca
from tests.helpers import full_store

FAST = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
CERTS = settings(FAST, max_examples=50)  # each one a key, a certificate and a TLS handshake

names = st.text("ABCXYZabcxyz0189_.@-", min_size=1, max_size=64)
scopes = st.one_of(st.none(), st.lists(st.sampled_from(TOKEN_SCOPES), min_size=1,
                                       max_size=3, unique=True))
tokens = st.text(st.characters(min_codepoint=33, max_codepoint=0x10FFFF,
                               exclude_categories=("Cs", "Zs", "Zl", "Zp", "Cc")),
                 min_size=1, max_size=40)


def _line(name: str, sc: list[str] | None, token: str) -> str:
    return f"{name}{'' if sc is None else '[' + ','.join(sc) + ']'}:{token}"


pieces = st.sampled_from(["a", "b", "@", ":", "[", "]", ",", "#", "\n", "\r", " ", "\t",
                          "metadata", "release", "prewarm", "Release", "tok", "\x00", "\u00e9",
                          "\u2028", "\ud800"])
near_lines = st.builds(lambda n, sc, sep, t: f"{n}{sc}{sep}{t}",
                       st.sampled_from(["a", "b", "a b", "", "é", "x" * 65]),
                       st.sampled_from(["", "[release]", "[metadata,prewarm]", "[]", "[bogus]",
                                        "[release,release]", "[release"]),
                       st.sampled_from([":", "", "::"]), st.sampled_from(["tok", "", " t "]))
token_texts = st.one_of(st.text(max_size=300), st.lists(pieces, max_size=40).map("".join),
                        st.lists(near_lines, max_size=4).map("\n".join))


@FAST
@given(token_texts)
def test_any_tokens_text_is_a_token_set_or_a_config_error(text):
    try:
        out = parse_tokens(text, "tokens")
    except ConfigError:
        return
    assert out and all(isinstance(v, NamedToken) and v.token and v.scopes <= set(TOKEN_SCOPES)
                       for v in out.values())


@FAST
@given(st.dictionaries(names, st.tuples(scopes, tokens), min_size=1, max_size=5),
       st.lists(st.sampled_from(["", "# comment", "   "]), max_size=3))
def test_valid_tokens_lines_read_back_as_written(entries, noise):
    lines = [_line(n, sc, t) for n, (sc, t) in entries.items()] + noise
    out = parse_tokens("\n".join(lines), "tokens")
    assert {n: (v.token, v.scopes) for n, v in out.items()} == {
        n: (t.strip(), frozenset(TOKEN_SCOPES if sc is None else sc))
        for n, (sc, t) in entries.items()}


def _replace(path: Path, raw: bytes, mode: int) -> None:
    """A new file moved into place (as secret stores rotate): a change even within one
    tick of the file system's clock."""
    new = path.with_suffix(".new")
    new.write_bytes(raw)
    new.chmod(mode)
    os.replace(new, path)


@pytest.fixture
def tokens_path(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("a:tok-a\n")
    path.chmod(0o600)
    return path


@FAST
@given(raw=st.binary(max_size=200), mode=st.sampled_from([0o600, 0o400, 0o640, 0o644]))
def test_any_tokens_file_bytes_are_read_or_refuse_every_token(tokens_path, raw, mode):
    tokens = TokenSet.from_config(SideChannelConfig(tokens_file=str(tokens_path)))
    _replace(tokens_path, raw, mode)
    try:
        good = parse_tokens(raw.decode(), "t") if mode & 0o077 == 0 else None
    except (UnicodeDecodeError, ConfigError):
        good = None
    for named in (good or {"a": NamedToken("tok-a")}).values():
        found = tokens.find(named.token)
        if good is None:
            assert found is None  # fails closed, even for the token that was there
        else:
            assert found is not None and good[found[0]].token == named.token
    _replace(tokens_path, b"a:tok-a\n", 0o600)


leaf = st.one_of(st.none(), st.integers(), st.text(max_size=20), st.binary(max_size=8),
                 st.sampled_from(["commonName", "DNS", "URI", "IP Address", "DirName",
                                  "email", "othername"]))
shapes = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4).map(tuple), st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["subject", "subjectAltName", "issuer"]), inner,
                    max_size=3)), max_leaves=20)


@FAST
@given(cert=shapes, authorization=st.one_of(st.none(), st.text(max_size=30)),
       patterns=st.lists(st.text(max_size=16), min_size=1, max_size=3))
def test_any_certificate_shape_is_decided_cleanly(cert, authorization, patterns):
    ids = cert_identities(cert)
    assert all(isinstance(i, str) for i in ids)
    try:
        allowed = PeerAllowList.parse(",".join(patterns))
    except ConfigError:
        allowed = None
    authz = Authorizer(TokenSet({"t": NamedToken("tok", frozenset({"release"}))}), allowed)
    for scope in TOKEN_SCOPES:
        assert authz.decide(authorization, cert, scope).status in (200, 401, 403)


label = st.text("abcdexyz0189-", min_size=1, max_size=10).filter(
    lambda t: not t.startswith("-") and not t.endswith("-"))


@FAST
@given(pattern=st.lists(st.one_of(label, st.just("*"), st.just("?"), st.just("-")),
                        min_size=1, max_size=4).map("".join),
       identity=st.lists(label, min_size=1, max_size=4).map(".".join))
def test_a_pattern_without_a_dot_matches_only_one_label(pattern, identity):
    if PeerAllowList([pattern]).allows([identity]):
        assert "." not in identity


dns = st.one_of(st.lists(label, min_size=1, max_size=3).map(".".join),
               st.builds(lambda a, b: f"decode-{a}.{b}kv.internal", label,
                         st.sampled_from(["", "evil.", "x.y."])))
sans = st.one_of(
    dns.map(x509.DNSName),
    st.integers(0, 255).map(lambda i: x509.IPAddress(ipaddress.ip_address(f"10.0.0.{i}"))),
    st.builds(lambda h, p: x509.UniformResourceIdentifier(f"spiffe://{h}/{p}"), dns, label),
    st.ip_addresses().map(x509.IPAddress),
    dns.map(lambda h: x509.RFC822Name(f"ops@{h}")),
    dns.map(lambda h: x509.DirectoryName(x509.Name([x509.NameAttribute(
        NameOID.COMMON_NAME, h)]))),
    st.just(x509.RegisteredID(ObjectIdentifier("1.3.6.1.4.1.99999.1"))),
)


@pytest.fixture(scope="module")
def mtls_side_channel(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-pki")
    ca = new_ca(d)
    issue(ca, d, "server", "127.0.0.1")
    server = make_server(SideChannelConfig.load({
        "handshake_method": "http", "side_channel_port": 0, "ssl_certfile": str(d / "server.pem"),
        "ssl_keyfile": str(d / "server.key"), "ssl_ca_certs": str(d / "ca.pem"),
        "ssl_cert_reqs": "required", "ssl_allowed_peers": "decode-*.kv.internal,10.0.0.*"},
        environ={}), full_store(1))
    server.start()
    yield ca, d, server
    server.stop()


@CERTS
@given(names_=st.lists(sans, max_size=4), cn=st.one_of(st.none(), dns))
def test_real_certificates_with_any_names_get_a_clean_answer(mtls_side_channel, names_, cn):
    ca, d, server = mtls_side_channel
    if not names_ and not cn:
        cn = "nobody"
    cert, key = issue_with_names(ca, d, "client", names_, cn)
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    ctx.load_cert_chain(cert, key)
    with httpx.Client(verify=ctx, timeout=10) as c:
        status = c.get(f"https://127.0.0.1:{server.port}/v1/kv/handshake/0").status_code
    on_list = any(isinstance(n, x509.DNSName) and n.value.startswith("decode-")
                  and n.value.endswith(".kv.internal") and n.value.count(".") == 2
                  for n in names_) or any(
        isinstance(n, x509.IPAddress) and n.value in ipaddress.ip_network("10.0.0.0/24")
        for n in names_) or (cn is not None and cn.startswith("decode-")
                             and cn.endswith(".kv.internal") and cn.count(".") == 2)
    assert status == (200 if on_list else 403)

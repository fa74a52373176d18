"""The certificate factory of tests, benchmarks and the demo: throw-away CAs and
certificates from trustme, written as PEM files.

Every certificate is written as ``NAME.pem`` (the chain) and ``NAME.key`` (its key), the
CA as ``ca.pem``; ``combined=True`` writes key and chain together in ``NAME.pem``.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import trustme

__all__ = ["LOOPBACK", "issue", "issue_with_names", "new_ca", "write_certs"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def new_ca(d: Path | None = None, name: str = "ca") -> trustme.CA:
    """A new CA; its certificate written to ``d/NAME.pem`` when ``d`` is given."""
    ca = trustme.CA()
    if d is not None:
        ca.cert_pem.write_to_path(str(Path(d) / f"{name}.pem"))
    return ca


def issue(ca: trustme.CA, d: Path, name: str, *identities: str, combined: bool = False,
          key_suffix: str = ".key", cert_suffix: str = ".pem") -> Path:
    """A certificate of ``ca`` for ``identities`` (default: loopback) written under ``d``;
    returns the certificate's path (the key is next to it, unless ``combined``)."""
    d = Path(d)
    cert = ca.issue_cert(*(identities or LOOPBACK))
    path = d / f"{name}{cert_suffix}"
    if combined:
        cert.private_key_and_cert_chain_pem.write_to_path(str(path))
    else:
        cert.cert_chain_pems[0].write_to_path(str(path))
        cert.private_key_pem.write_to_path(str(d / f"{name}{key_suffix}"))
    return path


def issue_with_names(ca: trustme.CA, d: Path, name: str, sans: list[Any],
                     cn: str | None = None) -> tuple[str, str]:
    """A client certificate of ``ca`` with exactly these subjectAltNames (``cryptography``
    ``GeneralName``s: a DirName, an email, ... which trustme cannot make) and subject CN
    (none if None), written as ``NAME.pem`` and ``NAME.key``; returns both paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    key = ec.generate_private_key(ec.SECP256R1())  # fast to make, unlike RSA
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else
                        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvbridge tests")])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False))
    if sans:  # critical when the subject is empty of names, as RFC 5280 asks
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=not cn)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    cert_path, key_path = Path(d) / f"{name}.pem", Path(d) / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def write_certs(d: Path, names: Iterable[str] = ("server",), *,
                identities: Iterable[str] = LOOPBACK, other_ca: bool = False) -> Path:
    """``d/ca.pem`` and, per name, ``NAME.pem`` + ``NAME.key`` issued for ``identities``;
    ``other_ca``: also ``other-ca.pem``, an unrelated CA that trusts none of them.
    Returns ``d``."""
    d = Path(d)
    ca = new_ca(d)
    ids = tuple(identities)
    for name in names:
        issue(ca, d, name, *ids)
    if other_ca:
        new_ca(d, "other-ca")
    return d

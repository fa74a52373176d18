"""The certificate factory of tests, benchmarks and the demo: throw-away CAs and
certificates from trustme, written as PEM files.

Every certificate is written as ``NAME.pem`` (the chain) and ``NAME.key`` (its key), the
CA as ``ca.pem``; ``combined=True`` writes key and chain together in ``NAME.pem``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import trustme

__all__ = ["LOOPBACK", "issue", "new_ca", "write_certs"]

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

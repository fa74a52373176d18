"""The settings tree: every setting of kvbridge, declared once.

The CLI's flags and their environment reading (kvbridge/cli.py), ``SideChannelConfig``
(kvbridge/config.py), the connection budget (kvbridge/settings/budget.py), the vLLM
plug-in's ``kv_connector_extra_config`` keys (kvbridge/vllm/settings.py) and the tables of
docs/configuration.md (``kvbridge settings --markdown``) are made from it.
"""

from __future__ import annotations

import ssl

from kvbridge.settings.core import (
    DEFAULT_HOST,
    HANDSHAKE_METHODS,
    KV_LOAD_FAILURE_POLICIES,
    ROLES,
    ROUTING_POLICIES,
    Setting,
    Tree,
)
from kvbridge.trust import parse_trusted

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED,
              "0": ssl.CERT_NONE, "1": ssl.CERT_OPTIONAL, "2": ssl.CERT_REQUIRED}


def cert_reqs(value: object) -> int:
    """uvicorn's ``ssl_cert_reqs``: none/optional/required (or 0/1/2, ``CERT_*``) ->
    ``ssl.VerifyMode``; ``ValueError`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2):
        return value
    key = str(value).strip().lower().removeprefix("cert_")
    if key not in _CERT_REQS:
        raise ValueError("use none, optional or required (or 0, 1, 2)")
    return int(_CERT_REQS[key])


_SEC = 3600.0  # the longest any deadline may be
_SC = "side_channel"


def _sc(name: str, kind: object, default: object, help: str, env: str, **kw: object) -> Setting:
    """A side-channel setting: a ``SideChannelConfig`` field and a vLLM extra-config key."""
    return Setting(name, kind, default, help, _SC, env=(env,), extra_config=True, **kw)


SETTINGS = Tree([
    # -- the side channel (SideChannelConfig) ---------------------------------------------
    _sc("handshake_method", str, "zmq",
        "Side-channel transport: `zmq`, `http` or `etcd` (metadata published in etcd; needs "
        "`registry`, see [fleet.md](fleet.md) §4). A prefill serves this method and names it "
        "in its `kv_transfer_params`. A decode uses the method named there and falls back to "
        "its own setting; a decode set to `http` refuses `zmq` (a 400, see protocol.md §12), "
        "while a decode set to `zmq` accepts `http`.",
        "KVBRIDGE_HANDSHAKE_METHOD", vllm="VLLM_NIXL_HANDSHAKE_METHOD", flag="--handshake",
        choices=HANDSHAKE_METHODS, rule="case-insensitive; `etcd` needs `registry`"),
    _sc("handshake_timeout", float, 10.0, "Seconds allowed for one fetch (see below).",
        "KVBRIDGE_HANDSHAKE_TIMEOUT", vllm="VLLM_NIXL_HANDSHAKE_TIMEOUT",
        flag="--handshake-timeout", low=0.0, high=_SEC, low_open=True),
    _sc("side_channel_host", str, DEFAULT_HOST,
        "Address the side-channel server **binds**. It is also advertised when "
        "`advertise_host` is unset.", "KVBRIDGE_SIDE_CHANNEL_HOST",
        vllm="VLLM_NIXL_SIDE_CHANNEL_HOST", flag="--side-channel-host",
        rule="see \"Bind host vs advertise host\""),
    _sc("side_channel_port", int, 5600,
        "The side-channel port: one per instance, for all its ranks. `0` picks an ephemeral "
        "port; the bound port is what goes into `kv_transfer_params`.",
        "KVBRIDGE_SIDE_CHANNEL_PORT", vllm="VLLM_NIXL_SIDE_CHANNEL_PORT",
        flag="--side-channel-port", low=0, high=65535),
    _sc("advertise_host", str, None, "Address peers are told to connect to.",
        "KVBRIDGE_ADVERTISE_HOST", flag="--advertise-host", rule="not a wildcard"),
    _sc("token", str, None,
        "Shared secret. The server requires it; the client sends it.",
        "KVBRIDGE_SIDE_CHANNEL_TOKEN", rule="not together with `token_file`"),
    _sc("token_file", str, None, "File holding the token.",
        "KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE", flag="--side-channel-token-file",
        rule="readable, non-empty, no group or other permission bits"),
    _sc("ssl_certfile", str, None,
        "PEM certificate. The server serves TLS with it, and the client presents it. "
        "`kvbridge serve`: the API's `--ssl-certfile` unless given.",
        "KVBRIDGE_SSL_CERTFILE", flag="--side-channel-ssl-certfile",
        dest="side_channel_ssl_certfile",
        rule="required if `ssl_keyfile` is set, and if `ssl_cert_reqs` is not `none`"),
    _sc("ssl_keyfile", str, None,
        "PEM private key for `ssl_certfile`. May be omitted if the certificate file contains "
        "the key.", "KVBRIDGE_SSL_KEYFILE", flag="--side-channel-ssl-keyfile",
        dest="side_channel_ssl_keyfile"),
    _sc("ssl_ca_certs", str, None,
        "CA bundle. The server verifies client certificates with it, and the client verifies "
        "the server.", "KVBRIDGE_SSL_CA_CERTS", flag="--side-channel-ssl-ca-certs",
        dest="side_channel_ssl_ca_certs", rule="required if `ssl_cert_reqs` is not `none`"),
    _sc("ssl_cert_reqs", cert_reqs, ssl.CERT_NONE,
        "Client-certificate policy of the server: `none`, `optional`, `required` (also "
        "`0/1/2` or `CERT_*`).", "KVBRIDGE_SSL_CERT_REQS",
        flag="--side-channel-ssl-cert-reqs", dest="side_channel_ssl_cert_reqs",
        rule="one of those; anything but `none` needs `ssl_certfile` and `ssl_ca_certs` "
        "(without a certificate uvicorn would serve plaintext and check no client)"),
    _sc("max_message_bytes", int, 4 * 1024 * 1024,
        "Largest reply envelope the client accepts (4 MiB).", "KVBRIDGE_MAX_MESSAGE_BYTES",
        low=1024, high=1 << 30),
    _sc("registry", str, None,
        "etcd as `etcd://HOST:PORT` (`etcds://` for TLS): where `kvbridge serve --registry` "
        "registers, where `kvbridge proxy --registry` discovers instances, and where the "
        "`etcd` method publishes and reads metadata.", "KVBRIDGE_REGISTRY", flag="--registry",
        metavar="etcd://HOST:PORT", rule="scheme `etcd`/`etcds`, a host, no path"),
    _sc("registry_ca_certs", str, None, "CA bundle that verifies etcd; implies TLS.",
        "KVBRIDGE_REGISTRY_CA_CERTS", flag="--registry-ca-certs"),
    _sc("registry_certfile", str, None, "Client certificate presented to etcd.",
        "KVBRIDGE_REGISTRY_CERTFILE", flag="--registry-certfile",
        rule="with `registry_keyfile`"),
    _sc("registry_keyfile", str, None, "Key of `registry_certfile`.",
        "KVBRIDGE_REGISTRY_KEYFILE", flag="--registry-keyfile"),
    _sc("tokens_file", str, None,
        "Named tokens the server accepts (side channel over `http`, a prefill's "
        "`/v1/kv/release` and a decode's `/v1/kv/prewarm`), one `NAME:TOKEN` per line, `#` "
        "comments: one per peer, so one can be revoked. `NAME[SCOPE,...]:TOKEN` limits a "
        "token to some of `metadata` (side-channel fetches), `release`, `prewarm` (a line "
        "without scopes has all three): give a proxy `proxy[release,prewarm]:...`. Replaces "
        "`token` for what is accepted (`token` stays what this instance sends). Read again "
        "whenever it changes on disk; while it cannot be trusted, every token is refused: "
        "see \"Token\".", "KVBRIDGE_SIDE_CHANNEL_TOKENS_FILE",
        flag="--side-channel-tokens-file",
        rule="file checks as `token_file`; every line `NAME:TOKEN` or `NAME[SCOPE,...]:TOKEN`, "
        "`NAME` of `[A-Za-z0-9_.@-]`, scopes distinct ones of `metadata`, `release`, "
        "`prewarm`, no name twice, at least one line"),
    _sc("ssl_allowed_peers", str, None,
        "Comma-separated glob patterns (`decode-*.kv.internal`; `*` and `?` stay within one "
        "DNS label, never crossing a `.` or `/`): with mutual TLS, only a client certificate "
        "whose subject CN or one of whose subjectAltNames (DNS, URI, IP) matches one may "
        "fetch metadata (`http` side channel) or call the KV routes (a prefill's "
        "`/v1/kv/release`, a decode's `/v1/kv/prewarm`: the API must then require client "
        "certificates too); another valid certificate of the same CA, or none, gets 403.",
        "KVBRIDGE_SSL_ALLOWED_PEERS",
        flag="--side-channel-ssl-allowed-peers", rule="needs `ssl_cert_reqs=required`"),
    _sc("trusted_side_channels", parse_trusted, None,
        "Comma-separated `HOST` or `HOST:PORT` patterns (`prefill-*.kv.internal`, "
        "`10.0.0.5:5600`, `[fd00::1]:5600`; `*` and `?` stay within one DNS label, `*` alone "
        "is any host): the side channels this instance presents its token to. A fetch with "
        "a token from any other side channel (one a request's `kv_transfer_params` or a "
        "`/v1/kv/prewarm` call names) is refused before connecting, so whoever can name a "
        "host cannot collect the token. Unset: none (a `kvbridge serve --kv-peer` is "
        "trusted too). Without a token it has no effect.",
        "KVBRIDGE_TRUSTED_SIDE_CHANNELS", flag="--trusted-side-channels",
        rule="`HOST` or `HOST:PORT` each, an IPv6 address in brackets before a port, a port "
        "in 1-65535"),
    _sc("audit_log", str, None,
        "File to append one JSON line to per metadata fetch and refusal (`http` side "
        "channel) and per release or refused call of the KV routes: `time`, `peer`, `cert`, "
        "`token` (token name), `route`, `rank`, `result`. Refusals are rate-limited per "
        "outcome (100 at once, then 10 a second); a `suppressed` line counts those dropped. "
        "Unset: off.", "KVBRIDGE_AUDIT_LOG",
        flag="--audit-log", rule="opened at start (append)"),
    _sc("side_channel_isolation", str, "process",
        "Where the side-channel server runs: `process`, a process of its own that the "
        "instance (or vLLM's engine core) starts, hands its metadata and restarts with "
        "backoff if it dies, and that exits with it ([running.md](running.md), \"The "
        "side-channel process\"); or `thread`, a thread of the instance's own process (for "
        "embedding and debugging).",
        "KVBRIDGE_SIDE_CHANNEL_ISOLATION", flag="--side-channel-isolation",
        choices=("process", "thread")),
    _sc("side_channel_keep_alive_timeout", float, 30.0,
        "Seconds the side channel keeps an idle keep-alive connection (its own setting: "
        "`keep_alive_timeout` is the other servers').",
        "KVBRIDGE_SIDE_CHANNEL_KEEP_ALIVE_TIMEOUT", flag="--side-channel-keep-alive-timeout",
        low=0.0, high=_SEC, low_open=True),

    # -- connection budgets of every server of a process (kvbridge/guard/) ---------------
    Setting("max_connections", int, 1024,
            "Connections one server keeps. At the cap, the connection idle the longest (no "
            "request in flight) is closed for the new one; connections serving a request are "
            "never closed for this.", "budget", env=("KVBRIDGE_MAX_CONNECTIONS",),
            flag="--max-connections", low=1),
    Setting("first_byte_timeout", float, 10.0,
            "Seconds a new connection (after its TLS handshake) may stay silent before its "
            "first request; on https it also bounds the TLS handshake.", "budget",
            env=("KVBRIDGE_FIRST_BYTE_TIMEOUT",), flag="--first-byte-timeout", low=0.0,
            high=_SEC, low_open=True),
    Setting("head_timeout", float, 10.0,
            "Seconds a request head (request line and headers; a zmq message) may take once "
            "its first byte arrived. Slowloris clients are closed at this deadline.", "budget",
            env=("KVBRIDGE_HEAD_TIMEOUT",), flag="--head-timeout", low=0.0, high=_SEC,
            low_open=True),
    Setting("max_head_bytes", int, 32 * 1024,
            "Largest request head (request line and headers) every server reads: counted as "
            "it arrives, 431 and the connection closed past it. Bytes of a chunked body with "
            "no body data among them (trailers, chunk extensions) count the same. The side "
            "channel's is at most 16 KiB.", "budget", env=("KVBRIDGE_MAX_HEAD_BYTES",), flag="--max-head-bytes",
            low=1024),
    Setting("max_headers", int, 100,
            "Most header lines a request head (with its chunked body's trailers) may have on "
            "every server: 431 and the connection closed past it.", "budget", env=("KVBRIDGE_MAX_HEADERS",),
            flag="--max-headers", low=1),
    Setting("body_timeout", float, 30.0,
            "Seconds a request body may take once its head is complete; past it the "
            "connection is closed and the app sees a disconnect.", "budget",
            env=("KVBRIDGE_BODY_TIMEOUT",), flag="--body-timeout", low=0.0, high=_SEC,
            low_open=True),
    Setting("keep_alive_timeout", float, 5.0,
            "Seconds the engine API and the proxy keep an idle keep-alive connection (the "
            "side channel: `side_channel_keep_alive_timeout`). The proxy's own connections to "
            "engines expire after 4 s, before the engines close them.", "budget",
            env=("KVBRIDGE_KEEP_ALIVE_TIMEOUT",), flag="--keep-alive-timeout", low=0.0,
            high=_SEC, low_open=True),
    Setting("max_body_bytes", int, 8 * 1024 * 1024,
            "Largest JSON body the engine API and the proxy read (8 MiB): 413 above it.",
            "limits", env=("KVBRIDGE_MAX_BODY_BYTES",), low=1),
    Setting("max_answer_bytes", int, 8 * 1024 * 1024,
            "Largest answer the proxy reads whole from an engine (8 MiB): a prefill's answer "
            "(one token: a few KiB; an echoed prompt, more) and a decode's error body. Past "
            "it the client gets a 502 naming this limit and the connection is closed.",
            "limits", env=("KVBRIDGE_MAX_ANSWER_BYTES",), low=1),
    Setting("max_json_depth", int, 64,
            "Deepest nesting of arrays and objects in a JSON body: 400 above it, checked "
            "before any decoder recurses.", "limits", env=("KVBRIDGE_MAX_JSON_DEPTH",), low=1),

    # -- NIXL -----------------------------------------------------------------------------
    Setting("nixl_progress_delay_us", int, 1000,
            "Microseconds each NIXL agent's progress thread sleeps between polls "
            "(`kvbridge/_nixl.py`). nixl's Python wrapper sets `0`, which makes every agent's "
            "thread busy-poll a whole core even when idle; `0` here keeps that behaviour. "
            "The vLLM plug-in applies it to vLLM's own worker agent too.",
            "nixl", env=("KVBRIDGE_NIXL_PROGRESS_DELAY_US",), low=0),

    # -- the engine (kvbridge serve) ------------------------------------------------------
    Setting("role", str, "both", "What the instance does: `prefill`, `decode` or `both` "
            "(also the vLLM plug-in's registration role).", "serve", flag="--role",
            choices=ROLES, extra_config=True),
    Setting("tp", int, 1, "Tensor-parallel size (worker processes).", "serve", flag="--tp",
            low=1),
    Setting("host", str, DEFAULT_HOST, "Address the API (`serve`) or the proxy binds; "
            "`0.0.0.0` for every interface (as in deploy/k8s).", "server", flag="--host"),
    Setting("port", int, 8000, "Port of the API (`serve`) or the proxy; `0`: any free one.",
            "server", flag="--port", low=0, high=65535),
    Setting("dtype", str, "float32", "Weights and KV cache dtype.", "serve", flag="--dtype",
            choices=("float32", "float64", "bfloat16")),
    Setting("num_blocks", int, 256, "KV blocks per worker.", "serve", flag="--num-blocks",
            low=1),
    Setting("block_size", int, 16, "Tokens per KV block.", "serve", flag="--block-size", low=1),
    Setting("kv_load_failure_policy", str, "recompute",
            "Decode: what a failed KV load does (`recompute` the prompt, or `fail`).", "serve",
            flag="--kv-load-failure-policy", choices=KV_LOAD_FAILURE_POLICIES),
    Setting("kv_lease_seconds", float, 30.0,
            "Prefill: held blocks are freed after this long even if unread.", "serve",
            flag="--kv-lease-seconds", low=0.0, low_open=True),
    Setting("transfer_timeout", float, 30.0, "Decode: seconds a started READ may take.",
            "serve", flag="--transfer-timeout", low=0.0, low_open=True),
    Setting("read_validation", str, "auto",
            "vLLM plug-in: every KV READ checked against block tags (`auto`: a peer with "
            "tags is validated, one without, such as a stock vLLM, is read unvalidated and "
            "counted; `require`: a READ from a peer without tags fails, as a load failure; "
            "`off`: no tags kept or read). See [vllm.md](vllm.md) §6.", "vllm",
            env=("KVBRIDGE_READ_VALIDATION",), choices=("auto", "require", "off"),
            extra_config=True),
    Setting("hold_keys", str, "require",
            "vLLM plug-in, prefill: a READ-done note releases a hold only with the hold's key, "
            "which `kv_transfer_params` carry (`require`); `off`: any note naming the request "
            "releases it, as in vLLM (for stock vLLM decodes, whose notes carry no key). See "
            "[vllm.md](vllm.md) §6b.", "vllm", env=("KVBRIDGE_HOLD_KEYS",),
            choices=("require", "off"), extra_config=True),
    Setting("registry_ttl", int, 10,
            "Seconds the registration (an etcd lease) outlives a crashed instance.", "serve",
            env=("KVBRIDGE_REGISTRY_TTL",), flag="--registry-ttl", low=1, extra_config=True),
    Setting("api_url", str, None,
            "vLLM plug-in: the URL of this vLLM server's API as clients reach it; setting it "
            "registers the instance in `registry`.", "serve", extra_config=True,
            rule="`http://` or `https://`; needs `registry`"),

    # -- an instance across nodes (kvbridge serve, vLLM's names) --------------------------
    Setting("nnodes", int, 1, "Nodes this instance spans; each holds `--tp / --nnodes` ranks.",
            "multinode", env=("KVBRIDGE_NNODES",), flag="--nnodes", low=1,
            rule="`--tp` a multiple of it"),
    Setting("node_rank", int, 0,
            "This node's index: 0 is the head (API, scheduler, side channel).", "multinode",
            env=("KVBRIDGE_NODE_RANK",), flag="--node-rank", low=0,
            rule="below `nnodes`; > 0 goes with `--headless`"),
    Setting("master_addr", str, None, "The head node's address (torch.distributed rendezvous).",
            "multinode", env=("KVBRIDGE_MASTER_ADDR",), flag="--master-addr",
            rule="required with `nnodes` > 1"),
    Setting("master_port", int, 29500, "Rendezvous port on the head node.", "multinode",
            env=("KVBRIDGE_MASTER_PORT",), flag="--master-port", low=1, high=65535),
    Setting("node_timeout", float, 120.0,
            "Seconds to wait for every node to join (and for a silent peer before it is "
            "declared gone).", "multinode", env=("KVBRIDGE_NODE_TIMEOUT",),
            flag="--node-timeout", low=0.0, high=_SEC, low_open=True),

    # -- the proxy ------------------------------------------------------------------------
    Setting("routing", str, "least-outstanding",
            "How the proxy picks among compatible instances.", "proxy", flag="--routing",
            choices=ROUTING_POLICIES),
    Setting("timeout", float, 300.0,
            "Seconds the proxy waits for an engine, in all: the prefill hop's whole answer "
            "(unless `prefill_timeout`), a decode's first byte, and each read and write. "
            "Past it a 504 (or another decode, where one may continue). A streamed answer "
            "runs on as long as its bytes keep coming.", "proxy",
            flag="--timeout", low=0.0, low_open=True),
    Setting("prefill_timeout", float, None,
            "Seconds the prefill hop may take in all, however its answer trickles (its one "
            "resend on a new connection included): past it another prefill is tried, or the "
            "client gets a 504 naming this flag (unset: `timeout`).", "proxy",
            flag="--prefill-timeout", low=0.0, low_open=True),
    Setting("first_token_from", str, "prefill",
            "Where a streamed answer's first token comes from: `prefill` sends it as soon as "
            "the prefill sampled it and the decode continues after it "
            "(`kv_transfer_params.sent_token_ids`); `decode`: every token from the decode, "
            "as vLLM's proxy does.", "proxy", env=("KVBRIDGE_FIRST_TOKEN_FROM",),
            flag="--first-token-from", choices=("prefill", "decode")),
    Setting("admin_token_file", str, None,
            "The token of the routes set to `token` (`Authorization: Bearer <token>`, 401 "
            "otherwise).", "proxy", env=("KVBRIDGE_ADMIN_TOKEN_FILE",),
            flag="--admin-token-file", rule="file checks as `token_file`"),
    Setting("admin_routes", str, None,
            "The admin routes `/v1/fleet`, `/healthz/backends` and `GET /v1/kv/prewarm` on the "
            "user port: `off` not served (404), `token` behind `admin_token_file`, `open` to "
            "every client. Unset: `token` with `admin_token_file`, else `off`. `/health` is "
            "always open.", "proxy", env=("KVBRIDGE_ADMIN_ROUTES",), flag="--admin-routes",
            choices=("off", "token", "open"), rule="`token` needs `admin_token_file`"),
    Setting("metrics_route", str, None,
            "`/metrics` on the user port, the same choices (unset: as `admin_routes`): e.g. "
            "`--admin-token-file F --metrics-route open` lets Prometheus scrape without the "
            "admin token.", "proxy", env=("KVBRIDGE_METRICS_ROUTE",), flag="--metrics-route",
            choices=("off", "token", "open")),
])

# How a port-in-use error names the side-channel port setting.
SIDE_CHANNEL_PORT_SETTING = "--side-channel-port / KVBRIDGE_SIDE_CHANNEL_PORT"

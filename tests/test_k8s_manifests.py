"""deploy/k8s/: every manifest is valid against the Kubernetes schemas (offline, with the
pinned kubernetes-validate), every reference inside resolves, and every kvbridge command
line in them is accepted by kvbridge's own parser. Validated, not run on a cluster."""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvbridge.cli import (
    ENV_ONLY,
    REGISTRY,
    connection_budget,
    multinode_config,
    parse_args,
    side_channel_flags,
)
from kvbridge.config import SideChannelConfig, TLSConfig, parse_cert_reqs
from kvbridge.proxy import build_proxy_app
from kvbridge.settings import SETTINGS, flag_label
from kvbridge.tools.testing.certs import issue, new_ca
from tests.conftest import ROOT

K8S = ROOT / "deploy" / "k8s"
VERSIONS = ["1.30.0", "1.37.0"]  # an older cluster and the newest schemas shipped


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


DOCS = _docs()


def _pod_specs() -> list[tuple[str, dict, dict]]:
    """(name, pod template labels, pod spec) of every workload."""
    return [
        (
            d["metadata"]["name"],
            d["spec"]["template"]["metadata"]["labels"],
            d["spec"]["template"]["spec"],
        )
        for _, d in DOCS
        if d["kind"] in ("Deployment", "StatefulSet")
    ]


def test_the_manifests_are_there():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in DOCS}
    for needed in [
        ("Deployment", "kvbridge-prefill"),
        ("Deployment", "kvbridge-decode"),
        ("Deployment", "kvbridge-proxy"),
        ("StatefulSet", "kvbridge-etcd"),
        ("Service", "kvbridge-prefill"),
        ("Secret", "kvbridge-token"),
        ("Secret", "kvbridge-tls"),
    ]:
        assert needed in kinds


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("name", "doc"), DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS]
)
def test_valid_against_the_schemas(name, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_validation_can_fail():
    (doc,) = [
        d
        for _, d in DOCS
        if d["metadata"]["name"] == "kvbridge-prefill" and d["kind"] == "Deployment"
    ]
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_references_resolve():
    secrets = {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "Secret"}
    pods = _pod_specs()
    for name, _, spec in pods:
        for vol in spec.get("volumes", []):
            if "secret" in vol:
                assert vol["secret"]["secretName"] in secrets, (name, vol)
        for c in spec["containers"]:
            ports = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["port"] in ports, (name, probe)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])} | {"data"}, name
    for _, svc in DOCS:
        if svc["kind"] != "Service":
            continue
        selected = [
            (n, spec)
            for n, labels, spec in pods
            if svc["spec"]["selector"].items() <= labels.items()
        ]
        assert selected, svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            for n, spec in selected:
                named = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in named, (svc["metadata"]["name"], n, port)


def test_side_channel_probes_and_ports():
    (prefill,) = [spec for n, _, spec in _pod_specs() if n == "kvbridge-prefill"]
    c = prefill["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"api": 8000, "nixl": 5600}


POD_IP = "10.0.0.9"


def _as_in_the_pod(spec: dict, root: Path) -> tuple[list[str], dict[str, str]]:
    """The container's command line and environment as its pod sees them: every mounted
    secret's keys as real files under ``root`` (certificates from the factory, a token;
    a path outside the mounts stays missing), the downward API's pod IP."""
    secrets = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "Secret"}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    c = spec["containers"][0]
    ca = new_ca()
    for m in c.get("volumeMounts", []):
        d = root / m["mountPath"].lstrip("/")
        d.mkdir(parents=True)
        for key in secrets[volumes[m["name"]]["secret"]["secretName"]]["stringData"]:
            if key == "ca.crt":
                ca.cert_pem.write_to_path(str(d / key))
            elif key == "tls.crt":
                issue(ca, d, "tls", cert_suffix=".crt")  # tls.crt and tls.key
            elif key != "tls.key":
                (d / key).write_text("k8s-" + os.urandom(16).hex())
        for p in d.iterdir():  # with the secret volume's file mode
            p.chmod(volumes[m["name"]]["secret"].get("defaultMode", 0o644))
    args = [re.sub(r"(^|=)/", rf"\g<1>{root}/", a) for a in c["args"]]
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    env.update({e["name"]: POD_IP for e in c.get("env", [])
                if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"})
    return args, env


@pytest.mark.parametrize("name", ["kvbridge-prefill", "kvbridge-decode", "kvbridge-proxy"])
def test_kvbridge_accepts_the_command_lines(name, tmp_path):
    """Each command line, with the pod's files and environment, goes through its
    sub-command's own configuration building (as ``kvbridge serve``/``proxy`` do before
    they bind): the budget, the side channel (token read, registry URL parsed, an address
    to advertise), TLS files loaded, the proxy's app built."""
    (spec,) = [spec for n, _, spec in _pod_specs() if n == name]
    argv, env = _as_in_the_pod(spec, tmp_path)
    args = parse_args(argv, environ=env)
    token = (tmp_path / "etc/kvbridge/token/token").read_text()
    assert args.registry == "etcd://kvbridge-etcd:2379"
    budget = connection_budget(args)
    SETTINGS.resolve(ENV_ONLY, environ=env)
    if args.command == "serve":
        assert args.host == "0.0.0.0" and args.registry_ttl == 10
        side = SideChannelConfig.load(side_channel_flags(args), env, flag_label, budget)
        assert side.token == token and side.advertised == POD_IP  # not the wildcard it binds
        assert (side.registry_endpoint.host, side.registry_endpoint.port) == ("kvbridge-etcd",
                                                                              2379)
        assert multinode_config(args, side) is None
        api_tls = TLSConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                            parse_cert_reqs(args.ssl_cert_reqs))
        for tls in (api_tls, side.tls):  # what uvicorn loads: the files are usable
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                tls.certfile, tls.keyfile)
            ssl.create_default_context(cafile=tls.ca_certs)
        if args.role == "prefill":  # kubelet probes bring no client certificate
            assert side.ssl_cert_reqs == ssl.CERT_OPTIONAL
    else:
        side = SideChannelConfig.load({n: getattr(args, n) for n in ["token_file", *REGISTRY]},
                                      env, flag_label)
        assert side.token == token
        build_proxy_app(args.prefill, args.decode, ca_certs=args.ca_certs,
                        client_cert=tuple(args.client_cert), timeout=args.timeout,
                        prewarm=args.prewarm, kv_token=side.token,
                        registry=side.registry_endpoint, routing=args.routing,
                        prefill_timeout=args.prefill_timeout, admin_routes=args.admin_routes,
                        metrics_route=args.metrics_route)


# --- deploy/k8s/multinode/: one instance across pods, as a LeaderWorkerSet ---------------
# The LeaderWorkerSet kind is a CRD with no schema in kubernetes-validate: its two pod
# templates are validated as core PodTemplates, its own fields and command lines here.

LWS = {
    path.stem: doc
    for path in sorted((K8S / "multinode").glob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if doc
}
TEMPLATES = ("leaderTemplate", "workerTemplate")


def _pod_template(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
            "template": template}


def test_multinode_manifests_are_there():
    assert set(LWS) == {"prefill", "decode"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("which", TEMPLATES)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_multinode_pod_templates_are_valid(role, which, version):
    template = LWS[role]["spec"]["leaderWorkerTemplate"][which]
    kubernetes_validate.validate(_pod_template(template), version, strict=True)


def test_multinode_template_validation_can_fail():
    lwt = LWS["prefill"]["spec"]["leaderWorkerTemplate"]
    template = yaml.safe_load(yaml.safe_dump(lwt["workerTemplate"]))
    template["spec"]["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["fieldPth"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_pod_template(template), VERSIONS[-1], strict=True)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_multinode_instance_is_one_group(role):
    """The leader is node 0 (the head, registered); every worker is a headless node whose
    rank is its LWS worker index; both agree on the group and kvbridge accepts both."""
    lws = LWS[role]
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    # a lost pod takes the whole instance down and up again (new epoch), as kvbridge expects
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    worker_env = {e["name"]: e for e in worker["env"]}
    assert worker_env["KVBRIDGE_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']")
    for c in (leader, worker):
        env = {e["name"]: e for e in c["env"]}
        assert env["KVBRIDGE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP")
    head = parse_args(leader["args"], environ={})
    nodes = []
    for rank in range(1, lwt["size"]):
        # KVBRIDGE_NODE_RANK: what the downward API gives
        nodes.append(parse_args(worker["args"], environ={"KVBRIDGE_NODE_RANK": str(rank)}))
    assert head.role == role and head.nnodes == lwt["size"] and head.node_rank == 0
    assert not head.headless
    assert head.registry == "etcd://kvbridge-etcd:2379"  # the head registers the instance
    assert head.master_addr == "$(LWS_LEADER_ADDRESS)"
    for rank, node in enumerate(nodes, start=1):
        assert node.headless and node.node_rank == rank and node.registry is None
        assert (node.role, node.tp, node.nnodes, node.master_addr, node.master_port) == (
            head.role, head.tp, head.nnodes, head.master_addr, head.master_port)
    for args in (head, *nodes):  # kvbridge's own multi-node checks (ranks per node, ...)
        mn = multinode_config(args, SideChannelConfig(advertise_host="10.0.0.9"))
        assert mn is not None and mn.nnodes == lwt["size"]
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports["rendezvous"] == head.master_port
    probe = leader["readinessProbe"]["httpGet"]
    if role == "prefill":  # the side channel: ready once every rank's metadata is in
        assert probe == {"path": "/readyz", "port": "nixl", "scheme": "HTTPS"}
    else:
        assert probe == {"path": "/health", "port": "api", "scheme": "HTTPS"}
        # a decode's ranks handshake with prefills themselves: trust and token on every node
        for node in nodes:
            assert node.token_file == head.token_file is not None
            assert node.trusted_side_channels == head.trusted_side_channels is not None
            assert node.side_channel_ssl_ca_certs == head.ssl_ca_certs
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):  # mounts resolve
        spec = template["spec"]
        mounts = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in spec.get("volumes", [])}

"""deploy/k8s/: every manifest is valid against the Kubernetes schemas (offline, with the
pinned kubernetes-validate), every reference inside resolves, and every kvbridge command
line in them is accepted by kvbridge's own parser. Validated, not run on a cluster."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from kvbridge.cli import _parser
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


@pytest.mark.parametrize("name", ["kvbridge-prefill", "kvbridge-decode", "kvbridge-proxy"])
def test_kvbridge_accepts_the_command_lines(name):
    (spec,) = [spec for n, _, spec in _pod_specs() if n == name]
    args = _parser().parse_args(spec["containers"][0]["args"])
    assert args.registry == "etcd://kvbridge-etcd:2379"
    if args.command == "serve":
        assert args.host == "0.0.0.0" and args.registry_ttl == 10
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["KVBRIDGE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )

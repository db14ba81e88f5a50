"""deploy/kubernetes: the manifests against the Kubernetes API schemas (kubernetes-validate,
strict: an unknown or misspelled field fails), the kvlb.toml they carry against kvlb itself
(`kvlb serve --check`), and the places where the manifests and that file must agree (ports,
probe paths, the drain against the grace period, the config mount, the DNS name of the fleet).
Offline: no cluster, nothing resolved.
"""

import pathlib
import re
import subprocess
import tomllib

import kubernetes_validate
import pytest
import yaml

from test_replica_launch import kvlb_binary

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.37.0"


def documents():
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def one(kind, name):
    found = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def seconds(v):
    m = re.fullmatch(r"(\d+)(ms|s|m)", v)
    assert m, v
    n, unit = int(m[1]), m[2]
    return n / 1000 if unit == "ms" else n * 60 if unit == "m" else n


@pytest.mark.parametrize("name,doc", documents(), ids=lambda x: x if isinstance(x, str) else "")
def test_each_manifest_validates_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_schema_check_catches_a_misspelled_field():
    doc = one("Deployment", "kvlb")
    spec = doc["spec"]["template"]["spec"]
    bad = {**doc, "spec": {**doc["spec"], "template": {**doc["spec"]["template"], "spec": {
        **spec, "terminationGracePeriodSecond": spec["terminationGracePeriodSeconds"]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


def kvlb_toml():
    return one("ConfigMap", "kvlb-config")["data"]["kvlb.toml"]


def test_kvlb_accepts_the_configmaps_configuration(tmp_path):
    path = tmp_path / "kvlb.toml"
    path.write_text(kvlb_toml())
    r = subprocess.run(
        [kvlb_binary(), "serve", "--check", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "configuration ok" in r.stdout and "DNS sources 1" in r.stdout, r.stdout
    # And --check refuses what kvlb would refuse.
    path.write_text(kvlb_toml() + 'policy = "fastest"\n')
    r = subprocess.run(
        [kvlb_binary(), "serve", "--check", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "policy" in r.stderr, (r.returncode, r.stderr)


def test_the_deployment_agrees_with_kvlbs_configuration():
    cfg = tomllib.loads(kvlb_toml())
    deploy = one("Deployment", "kvlb")
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(cfg["listen"][0].rsplit(":", 1)[1])
    assert ports["admin"] == int(cfg["admin"].rsplit(":", 1)[1])
    # Listening on every interface, or the kubelet's probes and the Service cannot reach it.
    assert cfg["listen"][0].startswith("0.0.0.0:") and cfg["admin"].startswith("0.0.0.0:")
    # The probes ask kvlb's own endpoints on the client port.
    assert c["livenessProbe"]["httpGet"] == {"path": cfg["liveness_path"], "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": cfg["readiness_path"], "port": "http"}
    # SIGKILL comes after the preStop pause and the whole drain.
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + seconds(cfg["drain_timeout"])
    # The config file is read where the ConfigMap is mounted, as a directory (a subPath mount
    # is never updated, and watch_config would see nothing).
    (mount,) = c["volumeMounts"]
    assert c["args"][c["args"].index("--config") + 1] == mount["mountPath"] + "/kvlb.toml"
    assert "subPath" not in mount and seconds(cfg["watch_config"]) > 0
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["configMap"]["name"] == "kvlb-config"
    # Guaranteed QoS with whole CPUs: what the static CPU manager pins.
    res = c["resources"]
    assert res["requests"] == res["limits"] and float(res["limits"]["cpu"]).is_integer()
    # io_uring needs a seccomp profile that allows it.
    assert pod["securityContext"]["seccompProfile"]["type"] in ("Unconfined", "Localhost")
    # The PodDisruptionBudget and the Service select these pods.
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    pdb = one("PodDisruptionBudget", "kvlb")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < deploy["spec"]["replicas"]
    svc = one("Service", "kvlb")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)


def test_the_fleet_is_found_through_the_headless_service():
    cfg = tomllib.loads(kvlb_toml())
    (source,) = cfg["replica_dns"]
    svc = one("Service", "vllm")
    assert svc["spec"]["clusterIP"] == "None"
    # dns+srv://_PORTNAME._tcp.SERVICE.NAMESPACE.svc...: the Service's named port.
    m = re.match(r"dns\+srv://_([a-z0-9-]+)\._tcp\.([a-z0-9-]+)\.", source)
    assert m, source
    port_names = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert m[1] in port_names and m[2] == svc["metadata"]["name"]
    # The KV event and replay ports kvlb subscribes to are the engines'.
    assert f"kv_events=tcp://{{host}}:{port_names['kv-events']}" in source
    assert f"kv_replay=tcp://{{host}}:{port_names['kv-replay']}" in source
    vllm = one("Deployment", "vllm")
    (c,) = vllm["spec"]["template"]["spec"]["containers"]
    events = next(a for a in c["args"] if a.startswith("--kv-events-config="))
    assert f"tcp://*:{port_names['kv-events']}" in events
    assert f"tcp://*:{port_names['kv-replay']}" in events
    assert svc["spec"]["selector"].items() <= vllm["spec"]["template"]["metadata"]["labels"].items()

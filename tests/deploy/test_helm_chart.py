"""helm/loraplex rendered and linted offline (Helm v4 embedded via helm-python-sdk), every object
validated (core: kubernetes-validate; RayService: the KubeRay CRD schema), and the Serve config
inside checked against the app itself (AppConfig, import path, vLLM 0.24 engine arguments)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from app.cli.serve_env import haproxy_bufsize
from app.config import AppConfig
from tests.helpers.k8s_objects import (
    object_problems,
    openapi_to_jsonschema,
    rayservice_openapi,
)
from tests.helpers.paths import REPO as ROOT
from tests.helpers.serve_configs import serve_config_problems

CHART = ROOT / "helm" / "loraplex"
VALUES_FILES = {
    "default": None,
    "h200-production": CHART / "ci" / "h200-production-values.yaml",
    "multi-worker-group": CHART / "ci" / "multi-worker-group-values.yaml",
}
MISSING_DEPENDENCY = "chart directory is missing these dependencies: kuberay-operator"


def values_of(name: str) -> dict | None:
    path = VALUES_FILES[name]
    return None if path is None else yaml.safe_load(path.read_text())


def render(values: dict | None) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values=values, name="prod", namespace="llm", is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module", params=list(VALUES_FILES))
def rendered(request) -> tuple[str, dict | None, list[dict]]:
    values = values_of(request.param)
    return request.param, values, render(values)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_lint_has_no_errors(name):
    report = helm.lint(str(CHART), values_of(name), strict=False)
    errors = [m for m in report["messages"] if m["severity"] >= 3] + report["errors"]
    warnings = [m["error"] for m in report["messages"] if m["severity"] == 2]
    assert errors == []
    # The only warning: the operator dependency is declared, not vendored (fetched on demand).
    assert warnings in ([], [MISSING_DEPENDENCY])


def test_every_object_validates(rendered):
    name, _, docs = rendered
    expected = {
        "default": ["PodDisruptionBudget", "RayService", "Secret", "ServiceAccount"],
        "h200-production": ["ConfigMap", "PodDisruptionBudget", "RayService", "Service", "ServiceAccount", "ServiceMonitor"],
        "multi-worker-group": ["PodDisruptionBudget", "RayService", "Secret", "Service", "ServiceAccount", "ServiceMonitor"],
    }
    assert sorted(d["kind"] for d in docs) == expected[name]
    problems = [p for d in docs for p in object_problems(d)]
    assert problems == []


def test_serve_config_validates_against_the_app(rendered):
    _, _, docs = rendered
    (rayservice,) = by_kind(docs, "RayService")
    serve_cfg = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert serve_config_problems(serve_cfg) == []
    app = serve_cfg["applications"][0]
    assert app["import_path"] == "app.main:build_app"


def test_objects_reference_each_other(rendered):
    """Mounts, Secrets, service account, selectors and ports line up across objects."""
    name, values, docs = rendered
    values = values or {}
    (rayservice,) = by_kind(docs, "RayService")
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    secrets = {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    accounts = {d["metadata"]["name"] for d in by_kind(docs, "ServiceAccount")}
    templates = pod_templates(rayservice)
    for tpl in templates:
        spec = tpl["spec"]
        (container,) = spec["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert set(mounts) <= set(volumes)
        # the tenants file the app reads is on the mounted tenants Secret
        assert Path(args["tenants_file"]).parent == Path(mounts["tenants"])
        tenants_secret = volumes["tenants"]["secret"]["secretName"]
        assert tenants_secret in secrets or tenants_secret == values.get("tenants", {}).get("existingSecret")
        assert spec["serviceAccountName"] in accounts
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert any(p["name"] == "metrics" and p["containerPort"] == 8080 for p in container["ports"])
    workers = templates[1:]
    for tpl, group in zip(workers, rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]):
        (container,) = tpl["spec"]["containers"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert args["cache_dir"] in mounts and "/dev/shm" in mounts
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= args["engine_deployment"]["ray_actor_options"]["num_gpus"] * args["engine"].get("tensor_parallel_size", 1)
        assert tpl["metadata"]["labels"]["loraplex.io/worker-group"] == group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # PodDisruptionBudget selects exactly the worker pods
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        matched = [t for t in templates if sel.items() <= t["metadata"]["labels"].items()]
        assert matched == workers
    # metrics Service selects every Ray pod; the ServiceMonitor selects that Service by its labels
    for svc in by_kind(docs, "Service"):
        assert all(svc["spec"]["selector"].items() <= t["metadata"]["labels"].items() for t in templates)
    for sm in by_kind(docs, "ServiceMonitor"):
        targets = [s for s in by_kind(docs, "Service") if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(targets) == 1
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in targets[0]["spec"]["ports"]}
    # the gateway Service (KubeRay's serve Service) targets Serve's HTTP port
    serve_svc = rayservice["spec"]["serveService"]
    assert serve_svc["spec"]["ports"][0]["targetPort"] == yaml.safe_load(rayservice["spec"]["serveConfigV2"])["http_options"]["port"]


@pytest.mark.parametrize("proxy", ["haproxy", "python", None])
def test_serve_proxy_mode_sets_the_data_path_env_on_every_ray_node(proxy):
    """haproxy (the default, as ``loraplex serve``): HAProxy + direct gRPC on every node; python: none of it."""
    values = None if proxy is None else {"serve": {"proxy": proxy}}
    (rayservice,) = by_kind(render(values), "RayService")
    for template in pod_templates(rayservice):
        (container,) = template["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if proxy == "python":
            assert not {"RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_HAPROXY_TUNE_BUFSIZE"} & env.keys()
        else:
            assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
            # HAProxy's buffer holds the gateway's default header limit, as `loraplex serve` sizes it
            assert env["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"] == str(haproxy_bufsize(AppConfig.model_fields["max_header_bytes"].default))


def test_h200_production_values_render_what_production_needs():
    docs = render(values_of("h200-production"))
    (rayservice,) = by_kind(docs, "RayService")
    spec = rayservice["spec"]
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    assert spec["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    (worker,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    pod = worker["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"]["claimName"] == "loraplex-model-weights"
    assert not by_kind(docs, "Secret")  # tenants come from the existing Secret
    (sa,) = by_kind(docs, "ServiceAccount")
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]
    (dashboard,) = by_kind(docs, "ConfigMap")
    panels = [p for p in json.loads(dashboard["data"]["loraplex.json"])["panels"] if p["type"] != "row"]
    assert panels and all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)
    assert by_kind(docs, "ServiceMonitor")


def test_multi_worker_group_values_render_two_gpu_groups():
    docs = render(values_of("multi-worker-group"))
    (rayservice,) = by_kind(docs, "RayService")
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["h200-ondemand", "h200-spot"]
    assert [g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for g in groups] == ["4", "1"]
    env = {e["name"]: e for e in groups[0]["template"]["spec"]["containers"][0]["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"].startswith("http://minio")
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    (tenants,) = by_kind(docs, "Secret")
    from app.gateway.tenants import TenantsFile

    parsed = TenantsFile.model_validate(yaml.safe_load(tenants["stringData"]["tenants.yaml"]))
    assert [t.name for t in parsed.tenants] == ["acme", "ops"]


def test_long_release_names_still_make_a_valid_rayservice():
    docs = render({**yaml.safe_load((CHART / "values.yaml").read_text()), "fullnameOverride": "a" * 60})
    (rayservice,) = by_kind(docs, "RayService")
    assert len(rayservice["metadata"]["name"]) <= 40 and object_problems(rayservice) == []


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"engine": {"max_lora": 8}}, "max_lora"),  # typo: the schema is the app's EngineConfig
        ({"engineDeployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 64}}}, "GPUs"),
        ({"store": {"uri": "http://bucket/prefix"}}, "uri"),
        ({"workerGroups": []}, "workerGroups"),
        ({"upgrade": {"strategy": "Recreate"}}, "strategy"),
    ],
)
def test_bad_values_are_refused(patch, message):
    values = copy.deepcopy(yaml.safe_load((CHART / "values.yaml").read_text()))
    for key, value in patch.items():
        values[key] = {**values[key], **value} if isinstance(value, dict) and isinstance(values.get(key), dict) else value
    with pytest.raises(helm.HelmError) as info:
        render(values)
    assert message in str(info.value)


def test_crd_check_is_strict():
    """The RayService check rejects what the API server (unknown field, wrong type, missing field)
    and KubeRay's operator (name, upgrade type, duplicate groups) would."""
    good = by_kind(render(None), "RayService")[0]
    assert object_problems(good) == []
    for mutate, expected in [
        (lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplica=3), "maxReplica"),
        (lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(minReplicas="1"), "minReplicas"),
        (lambda o: o["spec"]["rayClusterConfig"].pop("headGroupSpec"), "headGroupSpec"),
        (lambda o: o["spec"].update(rayClusterDeletionDelaySeconds=-1), "rayClusterDeletionDelaySeconds"),
        (lambda o: o["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=3), "imagePullPolicy"),
        (lambda o: o["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"].update(nodeSelectors={}), "nodeSelectors"),
        (lambda o: o["metadata"].update(name="9-" + "x" * 50), "DNS-1035"),
        (lambda o: o["spec"]["upgradeStrategy"].update(type="Recreate"), "upgradeStrategy"),
        (lambda o: o["spec"]["rayClusterConfig"]["workerGroupSpecs"].append(
            copy.deepcopy(o["spec"]["rayClusterConfig"]["workerGroupSpecs"][0])), "unique"),
    ]:
        bad = copy.deepcopy(good)
        mutate(bad)
        problems = object_problems(bad)
        assert problems and any(expected in p for p in problems), (expected, problems)


def test_crd_schema_conversion_keeps_constraints():
    schema = openapi_to_jsonschema(rayservice_openapi())
    worker = schema["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]["workerGroupSpecs"]["items"]
    assert worker["required"] == ["groupName", "maxReplicas", "minReplicas", "template"]
    assert worker["additionalProperties"] is False and worker["properties"]["replicas"]["maximum"] == 2**31 - 1


def test_values_schema_is_generated_from_the_app_config():
    sys.path.insert(0, str(ROOT / "helm"))
    import generate_values_schema

    assert (CHART / "values.schema.json").read_text() == generate_values_schema.render(), (
        "values.schema.json is stale: run `python helm/generate_values_schema.py`")


def test_kuberay_operator_is_a_declared_dependency_not_vendored():
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (dep,) = meta["dependencies"]
    assert dep["name"] == "kuberay-operator" and dep["condition"] == "kuberay-operator.enabled"
    assert not (CHART / "charts").exists()
    assert yaml.safe_load((CHART / "values.yaml").read_text())["kuberay-operator"]["enabled"] is False

"""Offline validation of rendered Kubernetes objects (no cluster).

- Core objects: ``kubernetes-validate`` (the API's OpenAPI schemas, strict: unknown fields fail).
- The KubeRay ``RayService``: its CRD's ``openAPIV3Schema`` (tests/data/
  kuberay_rayservice_v1_openapi.yaml) turned into a JSON Schema and checked with ``jsonschema``;
  subtrees marked ``x-loraplex-core-schema`` (pod templates, Services) are cut out of that check
  and validated as core objects instead, as the API server would.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import yaml

from tests.helpers.paths import REPO

DATA = REPO / "tests" / "data"
RAYSERVICE_SCHEMA = DATA / "kuberay_rayservice_v1_openapi.yaml"
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
CORE_MARK = "x-loraplex-core-schema"


def openapi_to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """A structural CRD schema → JSON Schema with the API server's strictness.

    Unknown fields fail (kubectl's default strict field validation), int32/int64 bound integers,
    ``x-kubernetes-int-or-string`` accepts both, ``nullable`` admits null, and core-object
    subtrees become bare objects (validated separately). CEL rules are not evaluated.
    """
    if node.get(CORE_MARK):
        return {"type": "object"}
    out: dict[str, Any] = {}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]  # `pattern` below constrains the string form only
    elif "anyOf" in node:
        out["anyOf"] = [openapi_to_jsonschema(n) for n in node["anyOf"]]
    elif "type" in node:
        out["type"] = [node["type"], "null"] if node.get("nullable") else node["type"]
    for key in ("enum", "required", "minimum", "maximum", "pattern", "maxLength", "minLength", "minItems", "maxItems"):
        if key in node:
            out[key] = node[key]
    if node.get("format") == "int32":
        out["minimum"], out["maximum"] = max(out.get("minimum", INT32[0]), INT32[0]), INT32[1]
    elif node.get("format") == "int64":
        out["minimum"], out["maximum"] = max(out.get("minimum", INT64[0]), INT64[0]), INT64[1]
    if "properties" in node:
        out["properties"] = {k: openapi_to_jsonschema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
            out["additionalProperties"] = False
    elif node.get("x-loraplex-trimmed"):
        out["maxProperties"] = 0  # a trimmed feature the chart must not render
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = openapi_to_jsonschema(node["additionalProperties"])
    if "items" in node:
        out["items"] = openapi_to_jsonschema(node["items"])
    return out


@lru_cache(maxsize=1)
def rayservice_openapi() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE_SCHEMA.read_text())


def core_subtrees(obj: Any, schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, str, dict]]:
    """(path, core definition, value) of every subtree the CRD marks as a core object."""
    if schema.get(CORE_MARK):
        yield path, schema[CORE_MARK], obj
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            sub = (schema.get("properties") or {}).get(key)
            if sub is not None:
                yield from core_subtrees(value, sub, f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, value in enumerate(obj):
            yield from core_subtrees(value, schema["items"], f"{path}[{i}]")


def core_problems(obj: dict[str, Any]) -> list[str]:
    """kubernetes-validate (strict) for each Kubernetes version in KUBE_VERSIONS."""
    problems = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')} (k8s {version}): {exc.message} at {list(exc.path)}")
    return problems


def as_core_object(definition: str, value: dict[str, Any], name: str) -> dict[str, Any]:
    """Wraps an embedded core subtree into a standalone object kubernetes-validate knows."""
    if definition == "io.k8s.api.core.v1.PodTemplateSpec":
        return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": value}
    if definition == "io.k8s.api.core.v1.Service":
        meta = dict(value.get("metadata") or {})
        meta.setdefault("name", name)
        return {"apiVersion": "v1", "kind": "Service", **{k: v for k, v in value.items() if k != "metadata"}, "metadata": meta}
    raise ValueError(f"no wrapper for {definition}")


def rayservice_problems(obj: dict[str, Any]) -> list[str]:
    """The RayService against the CRD schema, and its embedded core objects against Kubernetes'."""
    schema = rayservice_openapi()
    validator = jsonschema.Draft202012Validator(openapi_to_jsonschema(schema))
    problems = [f"RayService{'.'.join(str(p) for p in ['', *e.absolute_path])}: {e.message}"
                for e in validator.iter_errors(obj)]
    for path, definition, value in core_subtrees(obj, schema):
        problems += [f"{path}: {p}" for p in core_problems(as_core_object(definition, value, "embedded"))]
    return problems


DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RAYSERVICE_NAME = 47  # KubeRay: RayCluster names ≤ 53, minus the 6 characters it appends


def kuberay_operator_problems(obj: dict[str, Any]) -> list[str]:
    """What KubeRay's operator refuses beyond the CRD schema (its ValidateRayServiceMetadata /
    ValidateRayServiceSpec / ValidateRayClusterSpec, the rules a chart can break)."""
    problems = []
    name = obj.get("metadata", {}).get("name", "")
    if len(name) > MAX_RAYSERVICE_NAME or not DNS1035.match(name):
        problems.append(f"RayService name {name!r} must be a DNS-1035 label of at most {MAX_RAYSERVICE_NAME} characters")
    spec = obj.get("spec") or {}
    cluster = spec.get("rayClusterConfig") or {}
    head = cluster.get("headGroupSpec") or {}
    if not (head.get("template", {}).get("spec", {}).get("containers")):
        problems.append("headGroupSpec should have at least one container")
    if (head.get("headService") or {}).get("metadata", {}).get("name"):
        problems.append("headGroupSpec.headService.metadata.name must not be set")
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    groups = cluster.get("workerGroupSpecs") or []
    for group in groups:
        if not group.get("template", {}).get("spec", {}).get("containers"):
            problems.append(f"workerGroupSpec {group.get('groupName')} should have at least one container")
        if autoscaling and group.get("suspend"):
            problems.append("suspending worker groups is not supported with the autoscaler")
        bounds = (group.get("minReplicas", 0), group.get("replicas", 0), group.get("maxReplicas", 2**31 - 1))
        if all(isinstance(b, int) for b in bounds) and not bounds[0] <= bounds[1] <= bounds[2]:
            problems.append(f"workerGroupSpec {group.get('groupName')}: needs minReplicas <= replicas <= maxReplicas")
    names = [g.get("groupName") for g in groups]
    if len(names) != len(set(names)):
        problems.append(f"worker group names must be unique: {names}")
    strategy = (spec.get("upgradeStrategy") or {}).get("type")
    if strategy is not None and strategy not in ("NewCluster", "NewClusterWithIncrementalUpgrade", "None"):
        problems.append(f"upgradeStrategy.type {strategy!r} is not NewCluster, NewClusterWithIncrementalUpgrade or None")
    if not spec.get("serveConfigV2"):
        problems.append("serveConfigV2 is empty: a RayService without applications never becomes ready")
    return problems


def object_problems(obj: dict[str, Any]) -> list[str]:
    """Dispatch by kind: RayService → CRD schema; ServiceMonitor → structural checks; else core."""
    kind = obj.get("kind")
    if kind == "RayService":
        return rayservice_problems(obj) + kuberay_operator_problems(obj)
    if kind == "ServiceMonitor":
        spec = obj.get("spec") or {}
        ok = obj.get("apiVersion") == "monitoring.coreos.com/v1" and spec.get("selector", {}).get("matchLabels") and all(
            e.get("port") for e in spec.get("endpoints") or [{}])
        return [] if ok else [f"ServiceMonitor {obj.get('metadata', {}).get('name')}: needs selector.matchLabels and endpoints[].port"]
    return core_problems(obj)

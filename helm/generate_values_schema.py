"""Writes helm/loraplex/values.schema.json: the chart's own keys plus the app's pydantic models.

``engine``, ``engineDeployment``, ``gatewayDeployment`` and ``observability`` reach ``app.main:build_app`` verbatim,
so their schemas are generated from ``app.config.EngineConfig`` / ``DeploymentOptions`` /
``app.observability.config.ObservabilityConfig``: Helm then
rejects a typo at ``helm install`` time instead of the application failing on the cluster.
``tests/deploy/test_helm_chart.py`` fails when the committed file differs from what this script writes.

Usage: python helm/generate_values_schema.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "helm" / "loraplex" / "values.schema.json"

STR = {"type": "string"}
BOOL = {"type": "boolean"}
QUANTITY = {"type": ["string", "integer"], "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[mkMGTPE]|e[0-9]+)?$"}
OBJ = {"type": "object"}
LIST_OF_OBJ = {"type": "array", "items": OBJ}
STR_MAP = {"type": "object", "additionalProperties": STR}
K8S_NAME = {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", "maxLength": 63}
RESOURCES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "limits": {"type": "object", "additionalProperties": QUANTITY},
    },
}


def closed(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema that rejects unknown keys (a typo in values fails at install)."""
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        out["required"] = required
    out.update(extra)
    return out


def pod_group(extra: dict[str, Any]) -> dict[str, Any]:
    common = {
        "rayStartParams": {"type": "object", "additionalProperties": {"type": ["string", "integer", "number", "boolean"]}},
        "resources": RESOURCES,
        "shmSize": QUANTITY,
        "nodeSelector": STR_MAP,
        "tolerations": LIST_OF_OBJ,
        "affinity": OBJ,
        "podAnnotations": STR_MAP,
        "priorityClassName": STR,
    }
    return closed({**common, **extra}, required=["resources", "shmSize", *[k for k in extra if k != "replicas"]])


def chart_schema(app_defs: dict[str, Any]) -> dict[str, Any]:
    worker = pod_group({
        "name": {**K8S_NAME, "minLength": 1},
        "replicas": {"type": "integer", "minimum": 0},
        "minReplicas": {"type": "integer", "minimum": 0},
        "maxReplicas": {"type": "integer", "minimum": 1},
        "gpusPerPod": {"type": "integer", "minimum": 1, "maximum": 8},
    })
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "loraplex Helm values",
        **closed({
            "nameOverride": STR,
            "fullnameOverride": STR,
            "global": OBJ,
            "kuberay-operator": {"type": "object", "properties": {"enabled": BOOL}},
            "image": closed({
                "repository": {"type": "string", "minLength": 1},
                "tag": STR,
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }, required=["repository", "pullPolicy"]),
            "imagePullSecrets": LIST_OF_OBJ,
            "rayVersion": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"},
            "serviceAccount": closed({"create": BOOL, "name": STR, "annotations": STR_MAP}),
            "store": closed({
                "uri": {"type": "string", "pattern": r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?|file:///.+)$"},
                "endpointUrl": {"type": "string", "pattern": r"^(https?://.+)?$"},
                "region": STR,
                "credentialsSecret": K8S_NAME,
                "s3": {"$ref": "#/$defs/S3Options"},
            }, required=["uri"]),
            "tenants": closed({
                "existingSecret": K8S_NAME,
                "key": {"type": "string", "pattern": r"^[-._a-zA-Z0-9]+$"},
                "mountPath": {"type": "string", "pattern": r"^/"},
                "file": closed({"tenants": {"type": "array", "items": OBJ}}),
            }, required=["key", "mountPath"]),
            "model": closed({
                "cache": closed({"existingClaim": K8S_NAME, "sizeLimit": QUANTITY}),
                "offline": BOOL,
                "hfTokenSecret": K8S_NAME,
            }),
            "adapterCache": closed({"sizeLimit": QUANTITY, "maxBytes": {"type": "integer", "minimum": 1}},
                                   required=["sizeLimit", "maxBytes"]),
            "engine": {"$ref": "#/$defs/EngineConfig"},
            "engineDeployment": {"$ref": "#/$defs/DeploymentOptions"},
            "gatewayDeployment": {"$ref": "#/$defs/DeploymentOptions"},
            "observability": {"$ref": "#/$defs/ObservabilityConfig"},
            "serve": closed({
                "proxyLocation": {"enum": ["EveryNode", "HeadOnly", "Disabled"]},
                "proxy": {"enum": ["haproxy", "python"]},  # Serve's data path (as `loraplex serve --proxy`)
                "haproxyBufsize": {"type": "integer", "minimum": 16384},  # HAProxy's tune.bufsize
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "runtimeEnvVars": STR_MAP,
                "deployments": {"type": "array", "items": {"type": "object", "required": ["name"],
                                                          "properties": {"name": {"enum": ["Engine", "Gateway"]}}}},
            }, required=["proxyLocation", "port"]),
            "gateway": closed({"service": closed({
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "annotations": STR_MAP,
                "labels": STR_MAP,
            }, required=["type", "port"])}),
            "head": pod_group({}),
            "workerGroups": {"type": "array", "minItems": 1, "items": worker},
            "autoscaler": closed({
                "enabled": BOOL,
                "version": {"enum": ["v1", "v2"]},
                "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
            }),
            "upgrade": closed({
                "strategy": {"enum": ["NewCluster", "None"]},
                "clusterDeletionDelaySeconds": {"type": "integer", "minimum": 0},
            }),
            "podSecurityContext": OBJ,
            "containerSecurityContext": OBJ,
            "extraEnv": LIST_OF_OBJ,
            "podDisruptionBudget": closed({"enabled": BOOL, "maxUnavailable": {"type": ["integer", "string"]}}),
            "monitoring": closed({
                "serviceMonitor": closed({"enabled": BOOL, "interval": STR, "labels": STR_MAP}),
                "grafanaDashboard": closed({"enabled": BOOL, "labels": STR_MAP, "annotations": STR_MAP}),
            }),
        }, required=["image", "rayVersion", "store", "tenants", "engine", "engineDeployment", "gatewayDeployment",
                     "serve", "head", "workerGroups"]),
        "$defs": app_defs,
    }


def app_defs() -> dict[str, Any]:
    """JSON schemas of the app's EngineConfig, DeploymentOptions, S3Options and ObservabilityConfig
    (pydantic, extra=forbid)."""
    sys.path.insert(0, str(ROOT))
    from app.config import DeploymentOptions, EngineConfig, S3Options
    from app.observability.config import ObservabilityConfig

    defs: dict[str, Any] = {}
    for model in (EngineConfig, DeploymentOptions, S3Options, ObservabilityConfig):
        schema = model.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        defs[model.__name__] = schema
    return defs


def render() -> str:
    return json.dumps(chart_schema(app_defs()), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH.relative_to(ROOT)}")

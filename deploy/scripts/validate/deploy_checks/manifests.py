"""Kubernetes manifests: parsing, pod templates, and validation against the Kubernetes schemas."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import yaml

from .report import KUBE_VERSIONS, Report


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment and StatefulSet."""
    return [(d, d["spec"]["template"]) for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_ports(template: dict[str, Any]) -> dict[str | int, int]:
    out: dict[str | int, int] = {}
    for c in template["spec"]["containers"]:
        for p in c.get("ports", []):
            out[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                out[p["name"]] = p["containerPort"]
    return out


@functools.cache
def _schema(filename: str, version: str) -> Any:

    return _ORIGINAL_SCHEMA_CONTENTS(filename, version)


_ORIGINAL_SCHEMA_CONTENTS: Any = None


def kubernetes_validate(doc: dict[str, Any], version: str) -> str:
    """'' if `doc` is valid against the strict Kubernetes schema of `version`, else the error."""
    global _ORIGINAL_SCHEMA_CONTENTS
    from kubernetes_validate import utils

    if _ORIGINAL_SCHEMA_CONTENTS is None:
        # The schemas are large and read once per call otherwise.
        _ORIGINAL_SCHEMA_CONTENTS = utils.schema_contents
        utils.schema_contents = _schema
    try:
        utils.validate(doc, version, strict=True)
    except utils.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        return f"{path}: {exc.message}"
    except utils.SchemaNotFoundError as exc:
        return f"no schema: {exc}"
    return ""


BUILTIN_GROUPS = ("v1", "apps/v1", "autoscaling/v2", "batch/v1", "policy/v1", "networking.k8s.io/v1")


def check_kubernetes_docs(label: str, docs: list[dict[str, Any]], report: Report) -> list[dict[str, Any]]:
    """Schema-validate built-in kinds; return the custom resources."""
    crds = []
    for doc in docs:
        name = f"{label} {doc['kind']} {doc['metadata']['name']}"
        if doc["apiVersion"] in BUILTIN_GROUPS:
            for version in KUBE_VERSIONS:
                error = kubernetes_validate(doc, version)
                report.check(not error, f"{name}: Kubernetes {version} schema (strict)", error)
        else:
            crds.append(doc)
    return crds

"""Offline checks of kvplane's deployment artifacts, beyond what their schemas say.

    python -m deploy_checks compose RESOLVED.json     the compose stack, as `docker compose config
                                                      --format json` resolved it (all profiles)
    python -m deploy_checks dockerfile RESOLVED.json  deploy/docker/Dockerfile, and the compose
                                                      build targets in it
    python -m deploy_checks helm OUT_DIR              lint and render the chart for each values file,
                                                      validate every built-in resource against the
                                                      Kubernetes schemas, cross-check the manifests
    python -m deploy_checks mesh OUT_DIR              the Istio manifests against the chart

(run from deploy/scripts/validate, or with it on PYTHONPATH). One module per artifact:
`compose_checks.py` (with `compose_credentials.py`: no committed credential, each container's
own), `dockerfile_checks.py`, `chart_checks.py` (the rendered chart; `etcd_access_checks.py`: who
reaches etcd, and as which etcd user),
`ops_checks.py` (the dashboard, alert rules, autoscalers, the gateway's drain and the engines'
Services, budgets, monitors and OTEL settings; `promql.py` reads the metric names their queries
use), `pool_checks.py` (the InferencePool path: the pool, its picker and the decode sidecars),
`mesh_checks.py` (its Istio manifests, and every call the code makes decided against them and
against the NetworkPolicies: `client_calls.py` reads the calls, `istio_authz.py` and
`network_policy.py` decide them), over `manifests.py`
(Kubernetes documents and schemas), `kvplane_code.py` (kvplane's own parsers and settings model)
and `report.py`.

`helm` and `mesh` write the custom resources they found to OUT_DIR/*-crds.json, for
crd_schemas.mjs. validate_deploy.sh runs all of this; each command prints one line per check and
exits 1 if any failed.

Where possible a check runs kvplane's own code: flags go through the real argument parsers and
settings through the real settings model, so a renamed flag or setting fails here, not at start-up.
"""

from .chart_checks import check_chart_semantics, check_helm, merged_values, render_chart
from .compose_checks import check_compose
from .dockerfile_checks import check_dockerfile
from .etcd_access_checks import check_etcd_access
from .manifests import docs_of, kubernetes_validate, pod_templates
from .mesh_checks import (
    ISTIO_FIELDS,
    check_client_calls,
    check_mesh,
    client_requests,
    grpc_service_paths,
    unknown_fields,
)
from .ops_checks import check_operations
from .pool_checks import check_inference_pool
from .promql import PromQLError, metric_names
from .report import Report

__all__ = [
    "ISTIO_FIELDS",
    "PromQLError",
    "Report",
    "check_chart_semantics",
    "check_client_calls",
    "check_compose",
    "check_dockerfile",
    "check_etcd_access",
    "check_helm",
    "check_inference_pool",
    "check_mesh",
    "check_operations",
    "client_requests",
    "docs_of",
    "grpc_service_paths",
    "kubernetes_validate",
    "merged_values",
    "metric_names",
    "pod_templates",
    "render_chart",
    "unknown_fields",
]

// Validates custom resources (Istio, Prometheus Operator) against the OpenAPI schemas of their
// CRDs, as compiled into the @kubernetes-models packages.
//
//   node crd_schemas.mjs resources.json     a JSON array of resources
//
// Prints one line per resource and exits 1 if any is invalid or of a kind not known here.
// These schemas check types, enums and required fields; like the API server, they do not
// reject unknown fields, which deploy_checks.py checks for the fields kvplane uses.
import { readFileSync } from "node:fs";

const MODELS = {
  "security.istio.io/v1": ["@kubernetes-models/istio/security.istio.io/v1", ["AuthorizationPolicy", "PeerAuthentication", "RequestAuthentication"]],
  "networking.istio.io/v1": ["@kubernetes-models/istio/networking.istio.io/v1", ["DestinationRule", "VirtualService", "Sidecar"]],
  "monitoring.coreos.com/v1": ["@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", ["ServiceMonitor", "PodMonitor", "PrometheusRule"]],
};

async function modelFor(apiVersion, kind) {
  const entry = MODELS[apiVersion];
  if (!entry || !entry[1].includes(kind)) return null;
  const mod = await import(`${entry[0]}/${kind}`);
  return mod[kind];
}

const resources = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const resource of resources) {
  const name = `${resource.kind} ${resource.apiVersion} ${resource.metadata?.name}`;
  const Model = await modelFor(resource.apiVersion, resource.kind);
  if (Model === null) {
    console.log(`FAIL ${name}: no schema for this kind`);
    failed += 1;
    continue;
  }
  try {
    new Model(resource).validate();
    console.log(`ok   ${name}`);
  } catch (err) {
    console.log(`FAIL ${name}: ${err.message}`);
    failed += 1;
  }
}
console.log(`${resources.length - failed} valid, ${failed} invalid`);
process.exit(failed ? 1 : 0);

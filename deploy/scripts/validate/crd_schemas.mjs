// Validates custom resources (Istio, Prometheus Operator, Gateway API, the Inference Extension's
// InferencePool) against the OpenAPI schemas of their CRDs.
//
//   node crd_schemas.mjs resources.json     a JSON array of resources
//
// Prints one line per resource and exits 1 if any is invalid or of a kind not known here.
// The @kubernetes-models packages' schemas check types, enums and required fields; like the API
// server, they do not reject unknown fields, which deploy_checks checks for the fields kvplane
// uses. The InferencePool has no such package: schemas/inferencepool-v1.json is its v1 schema,
// written from the API's v1.0.0 definition, checked with Ajv; it refuses unknown fields.
import { readFileSync } from "node:fs";
import Ajv from "ajv";

const MODELS = {
  "security.istio.io/v1": ["@kubernetes-models/istio/security.istio.io/v1", ["AuthorizationPolicy", "PeerAuthentication", "RequestAuthentication"]],
  "networking.istio.io/v1": ["@kubernetes-models/istio/networking.istio.io/v1", ["DestinationRule", "VirtualService", "Sidecar"]],
  "monitoring.coreos.com/v1": ["@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", ["ServiceMonitor", "PodMonitor", "PrometheusRule"]],
  "gateway.networking.k8s.io/v1": ["@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1", ["Gateway", "HTTPRoute", "GRPCRoute"]],
};
const SCHEMAS = {
  "inference.networking.k8s.io/v1": { InferencePool: "schemas/inferencepool-v1.json" },
};

// Strict: a misspelt keyword in the schema file fails here, not silently (strictRequired off: the
// anyOf branches name properties defined beside them).
const ajv = new Ajv({ allErrors: true, strict: true, strictRequired: false });
const compiled = new Map();

async function validatorFor(apiVersion, kind) {
  const file = SCHEMAS[apiVersion]?.[kind];
  if (file) {
    if (!compiled.has(file)) {
      compiled.set(file, ajv.compile(JSON.parse(readFileSync(new URL(file, import.meta.url), "utf8"))));
    }
    const check = compiled.get(file);
    return (resource) => {
      if (!check(resource)) throw new Error(ajv.errorsText(check.errors, { dataVar: "" }));
    };
  }
  const entry = MODELS[apiVersion];
  if (!entry || !entry[1].includes(kind)) return null;
  const mod = await import(`${entry[0]}/${kind}`);
  const Model = mod[kind];
  return (resource) => new Model(resource).validate();
}

const resources = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const resource of resources) {
  const name = `${resource.kind} ${resource.apiVersion} ${resource.metadata?.name}`;
  const validate = await validatorFor(resource.apiVersion, resource.kind);
  if (validate === null) {
    console.log(`FAIL ${name}: no schema for this kind`);
    failed += 1;
    continue;
  }
  try {
    validate(resource);
    console.log(`ok   ${name}`);
  } catch (err) {
    console.log(`FAIL ${name}: ${err.message}`);
    failed += 1;
  }
}
console.log(`${resources.length - failed} valid, ${failed} invalid`);
process.exit(failed ? 1 : 0);

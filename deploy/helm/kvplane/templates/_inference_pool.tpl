{{/* The InferencePool path (inferencePool.enabled): names, the decode pods' labels and ports, and the
sidecar container that the decode Deployments (sim-engines.yaml, vllm-workers.yaml) add. */}}

{{- define "kvplane.inferencePoolName" -}}
{{- .Values.inferencePool.name | default (printf "%s-pool" (include "kvplane.fullname" .)) -}}
{{- end -}}

{{/* The Secret holding the routes' HMAC key: the values' own, or the chart's (route-key-secret.yaml). */}}
{{- define "kvplane.routeKeySecretName" -}}
{{- .Values.inferencePool.routeKeySecret.name | default (printf "%s-route-key" (include "kvplane.fullname" .)) -}}
{{- end -}}

{{/* "true" when a Deployment of role ROLE runs the sidecar: (dict "root" $ "role" "decode"). */}}
{{- define "kvplane.hasSidecar" -}}
{{- if and .root.Values.inferencePool.enabled (eq .role "decode") }}true{{ end -}}
{{- end -}}

{{/* The port an engine serves HTTP on: the decode engine's moves beside the sidecar, which takes
the pool's target port. (dict "root" $ "role" "decode") */}}
{{- define "kvplane.engineHttpPort" -}}
{{- if include "kvplane.hasSidecar" . -}}
{{- $pool := .root.Values.inferencePool -}}
{{- if eq (int $pool.sidecar.port) (int $pool.sidecar.enginePort) -}}
{{- fail "inferencePool.sidecar.port and inferencePool.sidecar.enginePort must differ: the sidecar and its decode engine share the pod" -}}
{{- end -}}
{{- $pool.sidecar.enginePort -}}
{{- else -}}
{{- .root.Values.engines.httpPort -}}
{{- end -}}
{{- end -}}

{{/* Every HTTP port an engine of the chart serves on: engines.httpPort, and the decode engines'
own beside their sidecars. */}}
{{- define "kvplane.engineHttpPorts" -}}
{{- $ports := list (int .Values.engines.httpPort) -}}
{{- if .Values.inferencePool.enabled -}}
{{- $ports = append $ports (int .Values.inferencePool.sidecar.enginePort) | uniq -}}
{{- end -}}
{{- toJson $ports -}}
{{- end -}}

{{/* The labels the pool selects: the decode pods of this release that run the sidecar. */}}
{{- define "kvplane.poolPodLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
kvplane.io/inference-pool: {{ include "kvplane.inferencePoolName" . }}
{{- end -}}

{{/* The route key, from its Secret, for the picker and every sidecar alike. */}}
{{- define "kvplane.routeKeyEnv" -}}
- name: KVPLANE_SIDECAR__ROUTE_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvplane.routeKeySecretName" . }}
      key: {{ .Values.inferencePool.routeKeySecret.key | quote }}
{{- end -}}

{{/*
`kvplane sidecar` beside a decode engine: on the pool's target port, calling its engine on
127.0.0.1 and the prefill engines a route names. Its leg deadlines and body limits are the
gateway's (settings.gateway, from the settings ConfigMap), read when the pod starts.
(dict "root" $ "enginePort" 8200)
*/}}
{{- define "kvplane.decodeSidecar" -}}
{{- $root := .root -}}
{{- $pool := $root.Values.inferencePool -}}
- name: sidecar
  image: {{ include "kvplane.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args: ["sidecar"]
  env:
    - name: KVPLANE_CONFIG
      value: /etc/kvplane/kvplane.yaml
    - name: KVPLANE_SIDECAR__LISTEN
      value: {{ printf "%s:%d" $root.Values.grpc.host (int $pool.sidecar.port) | quote }}
    # The engine beside it, in the same pod.
    - name: KVPLANE_SIDECAR__DECODE_URL
      value: {{ printf "http://127.0.0.1:%d" (int .enginePort) | quote }}
    {{- include "kvplane.routeKeyEnv" $root | nindent 4 }}
    - name: KVPLANE_TELEMETRY__OTLP_ENDPOINT
      value: {{ $root.Values.telemetry.otlpEndpoint | quote }}
  ports:
    - name: sidecar
      containerPort: {{ $pool.sidecar.port }}
      protocol: TCP
  readinessProbe:
    httpGet: {path: /health, port: sidecar}
    periodSeconds: 5
  livenessProbe:
    httpGet: {path: /health, port: sidecar}
    periodSeconds: 10
    timeoutSeconds: 3
  resources:
    {{- toYaml $pool.sidecar.resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: kvplane-settings
      mountPath: /etc/kvplane
      readOnly: true
    - name: sidecar-tmp
      mountPath: /tmp
{{- end -}}

{{- define "kvplane.decodeSidecarVolumes" -}}
- name: kvplane-settings
  configMap:
    name: {{ include "kvplane.fullname" . }}-settings
- name: sidecar-tmp
  emptyDir: {}
{{- end -}}

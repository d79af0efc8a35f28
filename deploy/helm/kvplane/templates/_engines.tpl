{{/* Names and environment shared by the engine Deployments (sim-engines.yaml, vllm-workers.yaml)
and their Services, budgets and monitors (engine-services.yaml). */}}

{{/* The chart's engine Deployments, as "sim-prefill", "sim-decode", "vllm-prefill", ...: one per
line, for `splitList`. */}}
{{- define "kvplane.engineComponents" -}}
{{- if .Values.engines.sim.enabled }}
sim-prefill
sim-decode
{{- end }}
{{- if .Values.engines.vllm.enabled }}
vllm-prefill
vllm-decode
{{- end }}
{{- end -}}

{{/* OpenTelemetry's own variables for an engine: its service name (vLLM's spans and the
connector's, or the sim-engine's, carry it) and, with telemetry.otlpEndpoint, where spans go.
(dict "root" $ "component" "sim-prefill") */}}
{{- define "kvplane.engineOtelEnv" -}}
- name: OTEL_SERVICE_NAME
  value: {{ printf "kvplane-%s" .component | quote }}
{{- if .root.Values.telemetry.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ printf "http://%s" .root.Values.telemetry.otlpEndpoint | quote }}
{{- end }}
{{- end -}}

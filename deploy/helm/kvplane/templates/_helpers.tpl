{{/* Names and labels shared by every template. */}}

{{- define "kvplane.fullname" -}}
{{- if contains "kvplane" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvplane" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* kvplane.labels: (dict "root" $ "component" "routing") */}}
{{- define "kvplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvplane
{{ include "kvplane.selectorLabels" . }}
{{- end -}}

{{- define "kvplane.selectorLabels" -}}
app.kubernetes.io/name: kvplane
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* etcd client endpoints as the JSON list KVPLANE_ETCD__ENDPOINTS takes. */}}
{{- define "kvplane.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $name := printf "%s-etcd" (include "kvplane.fullname" .) -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "%s-%d.%s.%s.svc:2379" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- toJson $eps -}}
{{- else -}}
{{- if not .Values.etcd.external.endpoints -}}
{{- fail "etcd.enabled is false: set etcd.external.endpoints" -}}
{{- end -}}
{{- toJson .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Pod-level settings shared by the kvplane Deployments. */}}
{{- define "kvplane.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod annotations and labels for mesh membership. */}}
{{- define "kvplane.meshLabels" -}}
sidecar.istio.io/inject: {{ ternary "true" "false" .Values.mesh.enabled | quote }}
{{- end -}}

{{/* Environment every kvplane process gets: settings file, addresses, secrets. */}}
{{- define "kvplane.env" -}}
- name: KVPLANE_CONFIG
  value: /etc/kvplane/kvplane.yaml
- name: KVPLANE_ETCD__ENDPOINTS
  value: {{ include "kvplane.etcdEndpoints" . | quote }}
- name: KVPLANE_GRPC__LISTEN
  value: {{ printf "%s:%d" .Values.grpc.host (int .Values.grpc.port) | quote }}
- name: KVPLANE_TELEMETRY__METRICS_HOST
  value: {{ .Values.metrics.host | quote }}
- name: KVPLANE_TELEMETRY__METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: KVPLANE_TELEMETRY__OTLP_ENDPOINT
  value: {{ .Values.telemetry.otlpEndpoint | quote }}
- name: KVPLANE_AUTH__MODE
  value: {{ .Values.auth.mode | quote }}
{{- if .Values.etcd.tls.enabled }}
{{- if not .Values.etcd.tls.clientSecret }}
{{- fail "etcd.tls.enabled: set etcd.tls.clientSecret (the services' CA for etcd, and client certificate)" }}
{{- end }}
- name: KVPLANE_ETCD__TLS_CA_FILE
  value: /etc/kvplane-etcd-tls/ca.crt
- name: KVPLANE_ETCD__TLS_CERT_FILE
  value: /etc/kvplane-etcd-tls/tls.crt
- name: KVPLANE_ETCD__TLS_KEY_FILE
  value: /etc/kvplane-etcd-tls/tls.key
{{- end }}
{{- if eq .Values.auth.mode "token" }}
- name: KVPLANE_AUTH__TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ include "kvplane.authSecretName" . }}
      key: {{ .Values.auth.tokensSecret.key }}
{{- end }}
{{- end -}}

{{/* The Secret holding the control plane's tokens: the values' own, or the chart's (auth-secret.yaml). */}}
{{- define "kvplane.authSecretName" -}}
{{- .Values.auth.tokensSecret.name | default (printf "%s-auth" (include "kvplane.fullname" .)) -}}
{{- end -}}

{{/* An engine's or the gateway's token for the control plane, from the tokens Secret (key: who). */}}
{{- define "kvplane.tokenEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvplane.authSecretName" .root }}
      key: {{ .key }}
{{- end -}}

{{- define "kvplane.configVolume" -}}
- name: settings
  configMap:
    name: {{ include "kvplane.fullname" . }}-settings
- name: tmp
  emptyDir: {}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ .Values.etcd.tls.clientSecret }}
{{- end }}
{{- end -}}

{{- define "kvplane.configMount" -}}
- name: settings
  mountPath: /etc/kvplane
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: /etc/kvplane-etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* NetworkPolicy "from" entries for the namespaces that scrape metrics. */}}
{{- define "kvplane.np.metricsFrom" -}}
{{- range .Values.networkPolicy.metricsNamespaces }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ . }}
{{- end }}
{{- end -}}

{{/* The ServiceAccount engine pods run as (sim-engines here; vLLM pods deployed elsewhere). */}}
{{- define "kvplane.engineServiceAccount" -}}
{{- .Values.engines.serviceAccount.name | default (printf "%s-engine" (include "kvplane.fullname" .)) -}}
{{- end -}}

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

{{/* Environment every kvplane process gets: settings file, addresses. */}}
{{- define "kvplane.env" -}}
- name: KVPLANE_CONFIG
  value: /etc/kvplane/kvplane.yaml
- name: KVPLANE_GRPC__LISTEN
  value: {{ printf "%s:%d" .Values.grpc.host (int .Values.grpc.port) | quote }}
- name: KVPLANE_TELEMETRY__METRICS_HOST
  value: {{ .Values.metrics.host | quote }}
- name: KVPLANE_TELEMETRY__METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: KVPLANE_TELEMETRY__OTLP_ENDPOINT
  value: {{ .Values.telemetry.otlpEndpoint | quote }}
{{- end -}}

{{/*
etcd's clients, each an etcd user named by its certificate's Common Name (etcd's
--client-cert-auth; `kvplane etcd-setup` makes the users): the services, and root for the setup
Job and backups. The gateway and the picker never reach etcd.
*/}}
{{- define "kvplane.etcdUser" -}}
{{- ternary "root" (printf "kvplane-%s" .) (eq . "root") -}}
{{- end -}}

{{/* The Secret of an etcd client's certificate: (dict "root" $ "client" "metadata"), or of the
members' with "client" "server": the values' own, or the chart's (etcd-certificates.yaml). */}}
{{- define "kvplane.etcdSecret" -}}
{{- $tls := .root.Values.etcd.tls -}}
{{- $own := ternary $tls.serverSecret (index $tls.clientSecrets .client | default "") (eq .client "server") -}}
{{- $own | default (printf "%s-etcd-%s" (include "kvplane.fullname" .root) .client) -}}
{{- end -}}

{{/* etcd's address and credentials for one client: (dict "root" $ "client" "metadata"). */}}
{{- define "kvplane.etcdEnv" -}}
{{- $e := .root.Values.etcd -}}
- name: KVPLANE_ETCD__ENDPOINTS
  value: {{ include "kvplane.etcdEndpoints" .root | quote }}
{{- if $e.tls.enabled }}
- name: KVPLANE_ETCD__TLS_CA_FILE
  value: /etc/kvplane-etcd-tls/ca.crt
- name: KVPLANE_ETCD__TLS_CERT_FILE
  value: /etc/kvplane-etcd-tls/tls.crt
- name: KVPLANE_ETCD__TLS_KEY_FILE
  value: /etc/kvplane-etcd-tls/tls.key
{{- else }}
{{- if not $e.allowInsecure }}
{{- fail "etcd.tls.enabled is false and etcd.allowInsecure is false: kvplane refuses a plaintext, unauthenticated etcd off loopback; turn TLS on (etcd.tls), or allow it (development)" }}
{{- end }}
- name: KVPLANE_ETCD__ALLOW_INSECURE
  value: "true"
{{- end }}
{{- end -}}

{{/* The client's own certificate, and nobody else's: (dict "root" $ "client" "metadata"). */}}
{{- define "kvplane.etcdVolume" -}}
{{- if .root.Values.etcd.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ include "kvplane.etcdSecret" . }}
{{- end }}
{{- end -}}

{{- define "kvplane.etcdMount" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: /etc/kvplane-etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The Secret holding the control plane's tokens: the values' own, or the chart's (auth-secret.yaml). */}}
{{- define "kvplane.authSecretName" -}}
{{- .Values.auth.tokensSecret.name | default (printf "%s-auth" (include "kvplane.fullname" .)) -}}
{{- end -}}

{{/* The Secret holding the gateways' shared cache-salt key: the values' own, or the chart's. */}}
{{- define "kvplane.cacheSaltSecretName" -}}
{{- .Values.gateway.cacheSaltKeySecret.name | default (printf "%s-cache-salt" (include "kvplane.fullname" .)) -}}
{{- end -}}

{{/*
Tokens travel as files in /etc/kvplane-auth, from the tokens Secret: a Secret volume follows the
Secret, and servers and clients read a changed token file again, so a token is rotated or
revoked by editing the Secret, without a restart. Each pod mounts only its own key.
*/}}
{{- define "kvplane.authDir" -}}/etc/kvplane-auth{{- end -}}

{{/* An engine's or the gateway's token file variable: (dict "root" $ "name" VARIABLE). */}}
{{- define "kvplane.tokenFileEnv" -}}
- name: {{ .name }}
  value: {{ include "kvplane.authDir" . }}/token
{{- end -}}

{{/* The tokens Secret's key KEY as the file FILE: (dict "root" $ "key" KEY "path" FILE). */}}
{{- define "kvplane.authVolume" -}}
- name: auth
  secret:
    secretName: {{ include "kvplane.authSecretName" .root }}
    items:
      - {key: {{ .key | quote }}, path: {{ .path }}}
{{- end -}}

{{- define "kvplane.authMount" -}}
- name: auth
  mountPath: {{ include "kvplane.authDir" . }}
  readOnly: true
{{- end -}}

{{- define "kvplane.configVolume" -}}
- name: settings
  configMap:
    name: {{ include "kvplane.fullname" . }}-settings
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "kvplane.configMount" -}}
- name: settings
  mountPath: /etc/kvplane
  readOnly: true
- name: tmp
  mountPath: /tmp
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

{{/*
gRPC TLS (grpc.tls). Every process finds its certificate in /etc/kvplane-tls, from a Secret in
the kubernetes.io/tls layout plus ca.crt: the services their server certificate (its ca.crt
verifies clients' certificates), each client its own (its ca.crt verifies the servers'). Secret
volumes follow the Secret, and servers and clients re-read changed files: a renewed certificate
is used without a restart.
*/}}
{{- define "kvplane.tlsDir" -}}/etc/kvplane-tls{{- end -}}

{{/* The Secret of a client's certificate: (dict "root" $ "client" "gateway"). */}}
{{- define "kvplane.clientTlsSecret" -}}
{{- $secret := index .root.Values.grpc.tls.clientSecrets .client -}}
{{- if not $secret -}}
{{- fail (printf "grpc.tls.enabled: set grpc.tls.clientSecrets.%s (its client certificate and the servers' CA)" .client) -}}
{{- end -}}
{{- $secret -}}
{{- end -}}

{{/* A gRPC server's authentication and TLS (metadata, routing, eviction); only the servers hold the token list. */}}
{{- define "kvplane.serverEnv" -}}
{{- $tls := .Values.grpc.tls -}}
{{- if and (eq .Values.auth.mode "mtls") (not (and $tls.enabled $tls.mutual)) }}
{{- fail "auth.mode mtls: the client certificate names the principal; set grpc.tls.enabled and grpc.tls.mutual" }}
{{- end }}
- name: KVPLANE_AUTH__MODE
  value: {{ .Values.auth.mode | quote }}
{{- if eq .Values.auth.mode "token" }}
- name: KVPLANE_AUTH__TOKENS_FILE
  value: {{ include "kvplane.authDir" . }}/tokens.json
{{- end }}
{{- if $tls.enabled }}
{{- if not $tls.serverSecret }}
{{- fail "grpc.tls.enabled: set grpc.tls.serverSecret (the services' certificate, and ca.crt for client certificates)" }}
{{- end }}
- name: KVPLANE_GRPC__TLS__CERT_FILE
  value: {{ include "kvplane.tlsDir" . }}/tls.crt
- name: KVPLANE_GRPC__TLS__KEY_FILE
  value: {{ include "kvplane.tlsDir" . }}/tls.key
{{- if $tls.mutual }}
- name: KVPLANE_GRPC__TLS__CLIENT_CA_FILE
  value: {{ include "kvplane.tlsDir" . }}/ca.crt
{{- end }}
{{- end }}
{{- end -}}

{{/* A client's TLS settings, named PREFIX + CA_FILE, CERT_FILE, ...: (dict "root" $ "prefix" "KVPLANE_TLS_"). */}}
{{- define "kvplane.clientTlsEnv" -}}
{{- $tls := .root.Values.grpc.tls -}}
{{- if $tls.enabled }}
- name: {{ .prefix }}CA_FILE
  value: {{ include "kvplane.tlsDir" . }}/ca.crt
{{- if $tls.mutual }}
- name: {{ .prefix }}CERT_FILE
  value: {{ include "kvplane.tlsDir" . }}/tls.crt
- name: {{ .prefix }}KEY_FILE
  value: {{ include "kvplane.tlsDir" . }}/tls.key
{{- end }}
{{- with $tls.serverName }}
- name: {{ $.prefix }}SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- else if .root.Values.grpc.allowPlaintextCredentials }}
# Plaintext gRPC between pods: the client may send its token over it (grpc.allowPlaintextCredentials).
- name: KVPLANE_CLIENT_ALLOW_PLAINTEXT
  value: "true"
{{- else }}
{{- fail "grpc.tls.enabled is false and grpc.allowPlaintextCredentials is false: the clients would refuse to send their tokens in clear; turn TLS on, or allow plaintext (in the mesh, or for development)" }}
{{- end }}
{{- end -}}

{{/* The certificate volume: (dict "root" $ "secret" NAME); nothing without TLS. */}}
{{- define "kvplane.tlsVolume" -}}
{{- if .root.Values.grpc.tls.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ .secret }}
{{- end }}
{{- end -}}

{{- define "kvplane.tlsMount" -}}
{{- if .Values.grpc.tls.enabled }}
- name: grpc-tls
  mountPath: {{ include "kvplane.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
A gRPC server's probe: Kubernetes' own gRPC probe without TLS; with TLS, which that probe cannot
speak, `kvplane health` run in the container, presenting the server's own certificate when
clients must present one (issue it for client auth too). (dict "root" $ "component" "routing"),
with "service" "liveness" for the health service that stays SERVING while the process runs (liveness
and startup: a process cut off from etcd is NOT_SERVING on "" and must not be restarted for it).
*/}}
{{- define "kvplane.grpcProbe" -}}
{{- $tls := .root.Values.grpc.tls -}}
{{- $dir := include "kvplane.tlsDir" . -}}
{{- if $tls.enabled }}
exec:
  command:
    - kvplane
    - health
    - {{ printf "localhost:%d" (int .root.Values.grpc.port) | quote }}
    - --tls-ca-file={{ $dir }}/ca.crt
    - --tls-server-name={{ $tls.serverName | default (printf "%s-%s" (include "kvplane.fullname" .root) .component) }}
    {{- if $tls.mutual }}
    - --tls-cert-file={{ $dir }}/tls.crt
    - --tls-key-file={{ $dir }}/tls.key
    {{- end }}
    - --timeout-s=4
    {{- if .service }}
    - --service={{ .service }}
    {{- end }}
# A Python process per check: give it time to start.
timeoutSeconds: 8
{{- else }}
grpc: {port: {{ .root.Values.grpc.port }}{{ if .service }}, service: {{ .service }}{{ end }}}
timeoutSeconds: 3
{{- end }}
{{- end -}}

{{/*
Every routing replica's own address, comma-separated: <fullname>-routing-<i>.<fullname>-routing-pods
.<namespace>.svc:<port>, one per services.routing.replicas (a StatefulSet behind a headless Service).
Gateways and engines hold the whole list: a gateway sends each conversation to its home replica and
hedges to another, and every node agent streams its engine's load and prefix cache to every replica.
*/}}
{{- define "kvplane.routingTargets" -}}
{{- $name := printf "%s-routing" (include "kvplane.fullname" .) -}}
{{- $targets := list -}}
{{- range $i := until (int .Values.services.routing.replicas) -}}
{{- $targets = append $targets (printf "%s-%d.%s-pods.%s.svc:%d" $name $i $name $.Release.Namespace (int $.Values.grpc.port)) -}}
{{- end -}}
{{- join "," $targets -}}
{{- end -}}

{{/* A prefill engine's KV-cache events (vLLM's --kv-events-config): ipc sockets in the pod's /tmp,
read by the engine's own node agent only, so the events open no port. */}}
{{- define "kvplane.kvEventsConfig" -}}
{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/kv-events", "replay_endpoint": "ipc:///tmp/kv-events-replay"}
{{- end -}}

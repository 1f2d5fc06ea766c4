{{/*
Names, labels and the small pieces every component shares. Ports are fixed here, not values: the
CLI's defaults, the probes and the orchestrator's pool addresses must agree, and one place keeps
them agreeing. Only the orchestrator's public Service port is a value.
*/}}

{{- define "specdec.servicePort" -}}
{{- if eq . "orchestrator" }}50050{{ else }}50051{{ end }}
{{- end }}

{{- define "specdec.healthPort" -}}
{{- if eq . "orchestrator" }}50060{{ else }}50061{{ end }}
{{- end }}

{{- /* Prometheus /metrics of every component (specdec_active_sessions, read by the HPAs
through a metrics adapter; the request, speculation and pass metrics of deploy/README.md). */ -}}
{{- define "specdec.metricsPort" -}}9090{{- end }}

{{/* A pod template's annotations: the component's podAnnotations, plus the prometheus.io scrape
annotations when metrics.podAnnotations is on (podAnnotations win on a clash). Call with
(dict "root" $ "component" ... "values" ...). */}}
{{- define "specdec.podAnnotations" -}}
{{- $annotations := deepCopy (.values.podAnnotations | default dict) }}
{{- if .root.Values.metrics.podAnnotations }}
{{- $annotations = merge $annotations (dict "prometheus.io/scrape" "true" "prometheus.io/port" (include "specdec.metricsPort" .) "prometheus.io/path" "/metrics") }}
{{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "specdec.tlsMountPath" -}}/etc/specdec/tls{{- end }}
{{- define "specdec.authMountPath" -}}/etc/specdec/auth{{- end }}

{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
"<release>-<chart>", or the release name alone when it already contains the chart name. Kept to
48 characters so "<fullname>-orchestrator" still fits the 63-character name limit.
*/}}
{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one component's resources. Call with (dict "root" $ "component" "draft"). */}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root) .component }}
{{- end }}

{{/*
"true" when the chart runs a draft pool, "" when it does not: with orchestrator.draftMethod ngram
or suffix the orchestrator drafts alone with a lookup (--draft local:METHOD) and no draft replica
is ever called, so draft-*.yaml render nothing. Call with the root context.
*/}}
{{- define "specdec.draftPool" -}}
{{- if has .Values.orchestrator.draftMethod (list "model" "hybrid") }}true{{ end }}
{{- end }}

{{/* The orchestrator's address of one pool (its --draft / --target). Call with
(dict "root" $ "component" "draft"). */}}
{{- define "specdec.poolAddress" -}}
{{- $service := include "specdec.componentName" . }}
{{- $port := include "specdec.servicePort" .component }}
{{- if eq .root.Values.discovery "kubernetes" }}
{{- printf "k8s://%s/%s:%s" .root.Release.Namespace $service $port }}
{{- else }}
{{- printf "dns:///%s.%s.svc.%s:%s" $service .root.Release.Namespace .root.Values.clusterDomain $port }}
{{- end }}
{{- end }}

{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades, so never include versions. */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" .root }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/part-of: specdec
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "specdec.image" -}}
{{- $repository := required "image.repository is required: the image built from deploy/Dockerfile" .Values.image.repository }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "specdec.orchestratorServiceAccountName" -}}
{{- if .Values.orchestrator.serviceAccount.create }}
{{- default (include "specdec.componentName" (dict "root" . "component" "orchestrator")) .Values.orchestrator.serviceAccount.name }}
{{- else }}
{{- required "orchestrator.serviceAccount.name is required when orchestrator.serviceAccount.create is false" .Values.orchestrator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The TLS Secret's name, or "" when TLS is off. */}}
{{- define "specdec.tlsSecretName" -}}
{{- if .Values.tls.enabled }}
{{- required "tls.secretName is required when tls.enabled is true: a Secret with ca.crt, tls.crt and tls.key" .Values.tls.secretName }}
{{- end }}
{{- end }}

{{/* TLS flags shared by all three servers; the health port stays plaintext regardless. */}}
{{- define "specdec.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert
- {{ include "specdec.tlsMountPath" . }}/tls.crt
- --tls-key
- {{ include "specdec.tlsMountPath" . }}/tls.key
- --tls-ca
- {{ include "specdec.tlsMountPath" . }}/ca.crt
{{- end }}
{{- end }}

{{- define "specdec.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "specdec.tlsMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "specdec.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "specdec.tlsSecretName" . }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end }}

{{/*
Environment common to every container. POD_NAME comes from the downward API and names the replica
in handles and logs; HOME and the Hugging Face cache point into /tmp (an emptyDir) because the
root filesystem is read-only. SPECDEC_CACHE_DIR is left to the image, which bakes the default
target there.
*/}}
{{- define "specdec.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: PYTHONUNBUFFERED
  value: "1"
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/huggingface
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $.Values.tracing.sampleRatio | toString | quote }}
{{- end }}
{{- end }}

{{- define "specdec.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
# Without this the kubelet re-owns every file of a model volume at each mount: minutes for large
# weights.
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "specdec.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
{{- end }}

{{/*
Probes, all native gRPC (grpc.health.v1) on the plaintext health port, since the kubelet presents
no client certificate to an mTLS service port. Service "" is the deep check (model loaded and
answering) used for startup and readiness; "liveness" is the shallow one (the server's loop
answers), so a long forward pass or a slow peer never gets a healthy replica restarted.
Call with (dict "root" $ "component" "draft" "values" .Values.draft).
*/}}
{{- define "specdec.probes" -}}
{{- $port := include "specdec.healthPort" .component | int }}
{{- $probes := .values.probes -}}
startupProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ $probes.startupPeriodSeconds }}
  failureThreshold: {{ $probes.startupFailureThreshold }}
  timeoutSeconds: {{ $probes.timeoutSeconds }}
readinessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ $probes.readinessPeriodSeconds }}
  failureThreshold: {{ $probes.readinessFailureThreshold }}
  timeoutSeconds: {{ $probes.timeoutSeconds }}
livenessProbe:
  grpc:
    port: {{ $port }}
    service: liveness
  periodSeconds: {{ $probes.livenessPeriodSeconds }}
  failureThreshold: {{ $probes.livenessFailureThreshold }}
  timeoutSeconds: {{ $probes.timeoutSeconds }}
{{- end }}

{{/*
--grace-seconds: how long the server lets in-flight calls finish after SIGTERM. The kubelet's
terminationGracePeriodSeconds counts from the start of the preStop sleep, so the drain gets what
is left after the sleep, less 5 s for the process to exit before SIGKILL.
*/}}
{{- define "specdec.graceSeconds" -}}
{{- $grace := sub (sub (int .values.terminationGracePeriodSeconds) (int .values.preStopSleepSeconds)) 5 }}
{{- if lt $grace 1 }}
{{- fail (printf "%s.terminationGracePeriodSeconds must exceed preStopSleepSeconds + 5 to leave time to drain" .component) }}
{{- end }}
{{- $grace }}
{{- end }}

{{/* preStop sleep: the endpoint turns terminating and callers stop sending before SIGTERM. */}}
{{- define "specdec.lifecycle" -}}
{{- if gt (int .values.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .values.preStopSleepSeconds }}"]
{{- end }}
{{- end }}

{{- define "specdec.strategy" -}}
strategy:
  type: RollingUpdate
  rollingUpdate:
    maxSurge: {{ .values.rollingUpdate.maxSurge }}
    maxUnavailable: {{ .values.rollingUpdate.maxUnavailable }}
{{- end }}

{{/* Scheduling constraints shared by every pod spec. */}}
{{- define "specdec.scheduling" -}}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

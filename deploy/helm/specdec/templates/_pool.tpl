{{/*
The draft and target pools have the same shape; draft-*.yaml and target-*.yaml each include these
with their own component name, so the two pools never drift apart. Only the draft pool has a
method (draft.method: its model, or a lookup that reads the target's model directory).
Call every template here with (dict "root" $ "component" "draft" "values" $.Values.draft).
*/}}

{{/* Where the model directory is mounted, or baked in, inside the container. */}}
{{- define "specdec.modelPath" -}}
{{- $model := .values.model }}
{{- $mount := printf "/models/%s" .component }}
{{- if eq $model.source "image" }}
{{- required (printf "%s.model.image.path is required when %s.model.source is image" .component .component) $model.image.path }}
{{- else if eq $model.source "persistentVolumeClaim" }}
{{- $inside := trimAll "/" $model.persistentVolumeClaim.path }}
{{- if $inside }}{{ printf "%s/%s" $mount $inside }}{{ else }}{{ $mount }}{{ end }}
{{- else if eq $model.source "hostPath" }}
{{- $mount }}
{{- else }}
{{- fail (printf "%s.model.source must be image, persistentVolumeClaim or hostPath" .component) }}
{{- end }}
{{- end }}

{{- define "specdec.modelVolume" -}}
{{- $model := .values.model }}
{{- if eq $model.source "persistentVolumeClaim" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required (printf "%s.model.persistentVolumeClaim.claimName is required when %s.model.source is persistentVolumeClaim" .component .component) $model.persistentVolumeClaim.claimName }}
    readOnly: true
{{- else if eq $model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required (printf "%s.model.hostPath.path is required when %s.model.source is hostPath" .component .component) $model.hostPath.path }}
    type: Directory
{{- end }}
{{- end }}

{{- define "specdec.modelVolumeMount" -}}
{{- if ne .values.model.source "image" }}
- name: model
  mountPath: /models/{{ .component }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "specdec.poolDevice" -}}
{{- if eq .values.device "auto" }}
{{- if gt (int .values.gpu) 0 }}cuda{{ else }}cpu{{ end }}
{{- else }}
{{- .values.device }}
{{- end }}
{{- end }}

{{/* resources plus nvidia.com/gpu in limits (requests default to limits for extended resources). */}}
{{- define "specdec.poolResources" -}}
{{- $resources := deepCopy (.values.resources | default dict) }}
{{- if gt (int .values.gpu) 0 }}
{{- $limits := deepCopy ($resources.limits | default dict) }}
{{- $_ := set $limits "nvidia.com/gpu" (int .values.gpu) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{- define "specdec.poolDeployment" -}}
{{- $root := .root }}
{{- $values := .values }}
{{- /* A lookup draft (draft.method ngram or suffix) loads no model: its --model is the target's
model directory, mounted as in the target's pods, read for the vocabulary (config and tokenizer,
no weights). draft.model then goes unused. */}}
{{- $modelPool := . }}
{{- if and (eq .component "draft") (ne $values.method "model") }}
{{- $modelPool = dict "root" $root "component" "target" "values" $root.Values.target }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  {{- if not $values.autoscaling.enabled }}
  replicas: {{ $values.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
  {{- include "specdec.strategy" . | nindent 2 }}
  template:
    metadata:
      labels:
        {{- include "specdec.labels" . | nindent 8 }}
      {{- with include "specdec.podAnnotations" . }}{{ . | trim | nindent 6 }}{{ end }}
    spec:
      # Pools never call the Kubernetes API: no token in the pod.
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ $values.terminationGracePeriodSeconds }}
      securityContext:
        {{- include "specdec.podSecurityContext" $root | nindent 8 }}
      {{- with include "specdec.scheduling" . }}{{ . | trim | nindent 6 }}{{ end }}
      containers:
        - name: {{ .component }}
          image: {{ include "specdec.image" $root | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - serve
            - {{ .component }}
            - --model
            - {{ include "specdec.modelPath" $modelPool | quote }}
            {{- if eq .component "draft" }}
            - --method
            - {{ $values.method | quote }}
            {{- if eq $values.method "suffix" }}
            - --suffix-cache
            - {{ $values.suffixCache | quote }}
            {{- end }}
            {{- end }}
            - --host
            - 0.0.0.0
            - --port
            - {{ include "specdec.servicePort" .component | quote }}
            - --health-port
            - {{ include "specdec.healthPort" .component | quote }}
            - --grace-seconds
            - {{ include "specdec.graceSeconds" . | quote }}
            - --device
            - {{ include "specdec.poolDevice" . }}
            - --dtype
            - {{ $values.dtype }}
            - --replica-id
            - $(POD_NAME)
            - --max-sessions
            - {{ $values.maxSessions | quote }}
            - --max-cached-tokens
            - {{ $values.maxCachedTokens | int64 | quote }}
            - --session-ttl
            - {{ $values.sessionTtlSeconds | quote }}
            - --max-num-speculative-tokens
            - {{ $values.maxNumSpeculativeTokens | quote }}
            - --max-pass-tokens
            - {{ $values.maxPassTokens | quote }}
            - --max-pass-sessions
            - {{ $values.maxPassSessions | quote }}
            - --packed-rows
            - {{ $values.packedRows | quote }}
            - --metrics-port
            - {{ include "specdec.metricsPort" . | quote }}
            {{- with include "specdec.tlsArgs" $root }}{{ . | trim | nindent 12 }}{{ end }}
          env:
            {{- include "specdec.env" $root | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ include "specdec.servicePort" .component }}
              protocol: TCP
            - name: health
              containerPort: {{ include "specdec.healthPort" .component }}
              protocol: TCP
            - name: metrics
              containerPort: {{ include "specdec.metricsPort" . }}
              protocol: TCP
          {{- include "specdec.probes" . | nindent 10 }}
          {{- with include "specdec.lifecycle" . }}{{ . | trim | nindent 10 }}{{ end }}
          resources:
            {{- include "specdec.poolResources" . | nindent 12 }}
          securityContext:
            {{- include "specdec.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- with include "specdec.modelVolumeMount" $modelPool }}{{ . | trim | nindent 12 }}{{ end }}
            {{- with include "specdec.tlsVolumeMount" $root }}{{ . | trim | nindent 12 }}{{ end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- with include "specdec.modelVolume" $modelPool }}{{ . | trim | nindent 8 }}{{ end }}
        {{- with include "specdec.tlsVolume" $root }}{{ . | trim | nindent 8 }}{{ end }}
{{- end }}

{{/*
Headless: the orchestrator keeps sessions on the replica that holds their caches, so it must see
every replica's address (EndpointSlices or DNS A records), not one load-balanced virtual IP.
*/}}
{{- define "specdec.poolService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "specdec.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ include "specdec.servicePort" .component }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
{{- end }}

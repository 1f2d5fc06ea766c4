{{/* HPA and PodDisruptionBudget, the same for all three components. */}}

{{/*
HPA for any component. The Pods metric specdec_active_sessions is what loads a replica here
(caches held, streams in flight); CPU utilisation is the fallback. The HPA follows the largest
recommendation of the metrics it can read, and while one cannot be read (no metrics adapter) it
still scales up on the others but skips scale-down.
*/}}
{{- define "specdec.hpa" -}}
{{- $autoscaling := .values.autoscaling }}
{{- if $autoscaling.enabled }}
{{- if gt (int $autoscaling.minReplicas) (int $autoscaling.maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas (%v) exceeds maxReplicas (%v)" .component $autoscaling.minReplicas $autoscaling.maxReplicas) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.componentName" . }}
  minReplicas: {{ $autoscaling.minReplicas }}
  maxReplicas: {{ $autoscaling.maxReplicas }}
  metrics:
    {{- if gt (int $autoscaling.activeSessionsPerReplica) 0 }}
    - type: Pods
      pods:
        metric:
          name: specdec_active_sessions
        target:
          type: AverageValue
          averageValue: {{ $autoscaling.activeSessionsPerReplica | quote }}
    {{- end }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $autoscaling.targetCPUUtilizationPercentage }}
  behavior:
    scaleDown:
      stabilizationWindowSeconds: {{ $autoscaling.scaleDownStabilizationSeconds }}
      policies:
        # Remove one replica at a time: each removal re-prefills that replica's sessions elsewhere.
        - type: Pods
          value: 1
          periodSeconds: 60
{{- end }}
{{- end }}

{{- define "specdec.pdb" -}}
{{- if .values.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specdec.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

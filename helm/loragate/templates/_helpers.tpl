{{/* Names and labels shared by every template. */}}

{{- define "loragate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loragate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "loragate.gateway.fullname" -}}{{ include "loragate.fullname" . | trunc 55 | trimSuffix "-" }}-gateway{{- end -}}
{{- define "loragate.engine.fullname" -}}{{ include "loragate.fullname" . | trunc 56 | trimSuffix "-" }}-engine{{- end -}}
{{- define "loragate.engine.headless" -}}{{ include "loragate.fullname" . | trunc 47 | trimSuffix "-" }}-engine-headless{{- end -}}
{{- define "loragate.redis.fullname" -}}{{ include "loragate.fullname" . | trunc 57 | trimSuffix "-" }}-redis{{- end -}}

{{- define "loragate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "loragate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "loragate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loragate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "loragate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "loragate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "loragate.image" -}}
{{- $tag := default .root.Chart.AppVersion .image.tag -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}

{{/* The policy ConfigMap's name: the user's, or the one this chart renders. */}}
{{- define "loragate.policyConfigMap" -}}
{{- default (printf "%s-policy" (include "loragate.fullname" .)) .Values.policy.existingConfigMap -}}
{{- end -}}

{{/* The Secret holding API keys (env vars the policy's `env:` keys read) and, maybe, the Redis URL. */}}
{{- define "loragate.secretName" -}}
{{- default (printf "%s-keys" (include "loragate.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{/* The Redis URL source: "" (none), or set for `--redis`. */}}
{{- define "loragate.redisEnabled" -}}
{{- if or .Values.redis.enabled .Values.redis.url .Values.redis.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* Pod and container security settings of every workload this chart runs. */}}
{{- define "loragate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "loragate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

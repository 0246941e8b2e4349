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
{{- define "loragate.vllm.fullname" -}}{{ include "loragate.fullname" . | trunc 58 | trimSuffix "-" }}-vllm{{- end -}}
{{- define "loragate.vllm.headless" -}}{{ include "loragate.fullname" . | trunc 49 | trimSuffix "-" }}-vllm-headless{{- end -}}
{{- define "loragate.redis.fullname" -}}{{ include "loragate.fullname" . | trunc 57 | trimSuffix "-" }}-redis{{- end -}}

{{/* Which engines this release runs (`engine.kind`): "true" or "". */}}
{{- define "loragate.engine.enabled" -}}{{- if ne .Values.engine.kind "vllm" -}}true{{- end -}}{{- end -}}
{{- define "loragate.vllm.enabled" -}}{{- if ne .Values.engine.kind "loragate" -}}true{{- end -}}{{- end -}}

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

{{/* A Kubernetes quantity in whole MiB, rounded down: an integer with an optional binary (Ki..Pi) or decimal
(k..P) suffix, the forms values.schema.json lets through for sizes the chart computes with. */}}
{{- define "loragate.quantityMiB" -}}
{{- $digits := regexFind "^[0-9]+" (toString .) -}}
{{- $suffix := trimPrefix $digits (toString .) -}}
{{- $factor := get (dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000) $suffix -}}
{{- div (mul (int64 $digits) $factor) 1048576 -}}
{{- end -}}

{{/* The engine's --adapter-cache-mb: `engine.adapters.cache.mb`, or the emptyDir's sizeLimit less room for two
downloads in flight (a download is not counted against the bound until it is published, and the kubelet
evicts a pod whose emptyDir outgrows its sizeLimit). Either must hold the largest adapter and stay below the
sizeLimit. */}}
{{- define "loragate.adapterCacheMb" -}}
{{- $a := .Values.engine.adapters -}}
{{- $limit := include "loragate.quantityMiB" $a.cache.sizeLimit | int64 -}}
{{- $max := int64 $a.maxMb -}}
{{- $mb := ternary (int64 $a.cache.mb) (sub $limit (mul 2 $max)) (not (kindIs "invalid" $a.cache.mb)) -}}
{{- if ge $mb $limit -}}
{{- fail (printf "engine.adapters.cache.mb (%d) must be below engine.adapters.cache.sizeLimit (%s = %d MiB): the kubelet evicts a pod whose emptyDir outgrows it" $mb $a.cache.sizeLimit $limit) -}}
{{- end -}}
{{- if lt $mb $max -}}
{{- fail (printf "the adapter cache (%d MiB) cannot hold an adapter of engine.adapters.maxMb (%d MiB): raise engine.adapters.cache.sizeLimit (room for two downloads is kept when cache.mb is null) or lower maxMb" $mb $max) -}}
{{- end -}}
{{- $mb -}}
{{- end -}}

{{/* The source prefixes the engines may fetch adapters from (--adapter-source-allow), as a JSON array:
`s3://<objectStore.bucket>/<objectStore.prefix>/` when a bucket is set, then `engine.adapters.sources.allow`
(a prefix listed in both, once). Empty: the engines fetch nothing. */}}
{{- define "loragate.adapterSources" -}}
{{- $os := .Values.objectStore -}}
{{- $allow := list -}}
{{- with $os.bucket -}}
{{- $prefix := trimSuffix "/" $os.prefix -}}
{{- $allow = append $allow (ternary (printf "s3://%s/%s/" . $prefix) (printf "s3://%s/" .) (ne $prefix "")) -}}
{{- end -}}
{{- range .Values.engine.adapters.sources.allow -}}
{{- if not (has . $allow) -}}{{- $allow = append $allow . -}}{{- end -}}
{{- end -}}
{{- toJson $allow -}}
{{- end -}}

{{/* The environment an adapter fetcher reads (a loragate engine, vLLM's agent): the object store's (boto3's
standard variables) and the Hub's, as YAML list items; empty when none is set. */}}
{{- define "loragate.sourceEnv" -}}
{{- $os := .Values.objectStore -}}
{{- with $os.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with $os.region }}
- name: AWS_REGION
  value: {{ . | quote }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
{{- with $os.credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $os.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $os.secretAccessKeyKey }}
{{- end }}
{{- include "loragate.hubEnv" . }}
{{- end -}}

{{/* HF_ENDPOINT and HF_TOKEN from `huggingface.*`, as YAML list items (each after a newline). */}}
{{- define "loragate.hubEnv" -}}
{{- $hf := .Values.huggingface -}}
{{- with $hf.endpoint }}
- name: HF_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with $hf.tokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $hf.tokenSecretKey }}
{{- end }}
{{- end -}}

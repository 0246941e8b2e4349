{{/* vLLM engines (`engine.kind` vllm or mixed): vllm-engine.yaml's pod and the gateway's --upstream-dns for them. */}}

{{/* The GPUs of one vLLM pod: tensorParallelSize x pipelineParallelSize over the engine's `nodes` pods, refused
where it does not divide (every pod of an engine gets the same share). */}}
{{- define "loragate.vllm.gpusPerPod" -}}
{{- $v := .Values.vllm -}}
{{- $gpus := mul $v.tensorParallelSize $v.pipelineParallelSize -}}
{{- if ne (mod $gpus $v.nodes) 0 -}}
{{- fail (printf "vllm.tensorParallelSize x vllm.pipelineParallelSize (%d x %d = %d GPUs) must be a multiple of vllm.nodes (%d): each pod of an engine gets the same number of GPUs" (int64 $v.tensorParallelSize) (int64 $v.pipelineParallelSize) $gpus (int64 $v.nodes)) -}}
{{- end -}}
{{- div $gpus $v.nodes -}}
{{- end -}}

{{/* "true" when `loragate vllm-agent` runs beside vLLM: LoRA on, the agent on, and a source allow-list (the
same `engine.adapters.sources.allow` / `objectStore.bucket` a loragate engine fetches from). */}}
{{- define "loragate.vllm.agent" -}}
{{- $v := .Values.vllm -}}
{{- if and $v.enableLora $v.agent.enabled (include "loragate.adapterSources" . | fromJsonArray) -}}true{{- end -}}
{{- end -}}

{{/* The gateway's --upstream-dns value for the vLLM engines' headless Service (gateway/engine_kinds.py). */}}
{{- define "loragate.vllm.upstreamDns" -}}
{{- printf "vllm=%s.%s.svc.cluster.local:%v" (include "loragate.vllm.headless" .) .Release.Namespace .Values.vllm.port -}}
{{- if include "loragate.vllm.agent" . }},agent={{ .Values.vllm.agent.port }}{{ end -}}
{{- end -}}

{{/* The label selector of every pod of the vLLM engines: servers or leaders (component vllm) and Ray workers
(component vllm-worker). */}}
{{- define "loragate.vllm.allPods" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "loragate.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [vllm, vllm-worker]
{{- end -}}

{{/* The arguments of `vllm serve` (its OpenAI server), the model first, as YAML list items. */}}
{{- define "loragate.vllm.args" -}}
{{- $v := .Values.vllm -}}
- {{ $v.model | quote }}
{{- with $v.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
- --host
- 0.0.0.0
- --port
- {{ $v.port | quote }}
- --dtype
- {{ $v.dtype }}
{{- with $v.maxModelLen }}
- --max-model-len
- {{ . | quote }}
{{- end }}
- --tensor-parallel-size
- {{ $v.tensorParallelSize | quote }}
{{- if gt (int $v.pipelineParallelSize) 1 }}
- --pipeline-parallel-size
- {{ $v.pipelineParallelSize | quote }}
{{- end }}
{{- if gt (int $v.nodes) 1 }}
- --distributed-executor-backend
- ray
{{- end }}
- --scheduling-policy  # the gateway sends each request's priority (gateway/vllm.py)
- priority
{{- if $v.enableLora }}
- --enable-lora
- --max-loras
- {{ $v.maxLoras | quote }}
- --max-lora-rank
- {{ $v.maxLoraRank | quote }}
- --max-cpu-loras
- {{ $v.maxCpuLoras | quote }}
{{- end }}
{{- range $v.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* One vLLM pod's spec. `role`: server (a StatefulSet's pod), leader (a LeaderWorkerSet group's first pod: the Ray
head, vLLM and the agent) or worker (a Ray worker joining its leader). */}}
{{- define "loragate.vllm.podSpec" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $v := $root.Values.vllm -}}
{{- $agent := and (include "loragate.vllm.agent" $root) (ne $role "worker") -}}
{{- $cache := include "loragate.vllm.agent" $root -}}
{{- $group := ternary "metadata.name" "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']" (eq $role "server") -}}
{{- $gpus := include "loragate.vllm.gpusPerPod" $root | int64 -}}
{{- if and $v.enableLora (lt (int64 $v.maxCpuLoras) (int64 $v.maxLoras)) -}}
{{- fail (printf "vllm.maxCpuLoras (%d) must be at least vllm.maxLoras (%d): vLLM keeps every adapter on the GPU in host memory too" (int64 $v.maxCpuLoras) (int64 $v.maxLoras)) -}}
{{- end -}}
{{- if not $v.model -}}
{{- fail "engine.kind vllm and mixed need vllm.model: a Hugging Face id or a directory under /models (vllm.modelCache.existingClaim)" -}}
{{- end -}}
{{- if and $cache (gt (int $v.nodes) 1) (not $v.agent.cacheClaim) -}}
{{- fail "vllm.nodes > 1: every Ray worker loads an adapter from the path the agent wrote it to, on its own node; set vllm.agent.cacheClaim to a ReadWriteMany PersistentVolumeClaim (or vllm.agent.enabled=false)" -}}
{{- end -}}
serviceAccountName: {{ include "loragate.serviceAccountName" $root }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
securityContext:
  {{- include "loragate.podSecurityContext" $root | nindent 2 }}
containers:
  - name: {{ ternary "vllm-worker" "vllm" (eq $role "worker") }}
    image: {{ printf "%s:%s" $v.image.repository $v.image.tag }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    {{- if eq $role "worker" }}
    # Joins the leader's Ray cluster, again until the leader's address resolves and its head answers (a worker
    # that exited would restart its whole group).
    command: ["sh", "-c", "until ray start --address=$(LWS_LEADER_ADDRESS):6379 --block; do sleep 5; done"]
    {{- else }}
    {{- if eq $role "leader" }}
    # The Ray head, then vLLM once every pod of the group has joined; "$@" is `vllm serve`'s arguments.
    command:
      - sh
      - -c
      - {{ printf "ray start --head --port=6379 && until [ \"$$(ray status 2>/dev/null | grep -c node_)\" -ge %d ]; do sleep 5; done && exec vllm serve \"$@\"" (int $v.nodes) | quote }}
      - vllm
    {{- else }}
    command: ["vllm", "serve"]
    {{- end }}
    args:
      {{- include "loragate.vllm.args" $root | nindent 6 }}
    {{- end }}
    env:
      - name: HOME  # writable (the root filesystem is not): vLLM's, Triton's and torch.compile's caches
        value: /home/vllm
      - name: USER  # the pod's uid has no passwd entry, which getpass.getuser() would otherwise need
        value: vllm
      - name: HF_HOME  # models downloaded from the Hub land in the model cache
        value: /models/huggingface
      {{- if $agent }}
      - name: VLLM_ALLOW_RUNTIME_LORA_UPDATING  # the agent loads catalog adapters through /v1/load_lora_adapter
        value: "True"
      {{- end }}
      {{- with include "loragate.hubEnv" $root }}
      {{- . | trim | nindent 6 }}
      {{- end }}
      {{- if and $cache $v.agent.cacheClaim }}
      - name: ADAPTER_CACHE_GROUP  # this engine's own directory on vllm.agent.cacheClaim
        valueFrom:
          fieldRef: {fieldPath: {{ $group | quote }}}
      {{- end }}
      {{- with $v.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if ne $role "worker" }}
    ports:
      - name: http
        containerPort: {{ $v.port }}
        protocol: TCP
    startupProbe:  # the download and load of a large model (and, for a group, its workers joining)
      httpGet: {path: /health, port: http}
      periodSeconds: {{ $v.startupProbe.periodSeconds }}
      failureThreshold: {{ $v.startupProbe.failureThreshold }}
    livenessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 10
      failureThreshold: 3
    readinessProbe:
      httpGet: {path: /health, port: http}
      periodSeconds: 5
      failureThreshold: 2
    {{- end }}
    resources:
      {{- $resources := deepCopy $v.resources }}
      {{- range $kind := list "requests" "limits" }}
      {{- $quantities := default (dict) (get $resources $kind) }}
      {{- $_ := set $quantities $v.gpu.resourceName $gpus }}
      {{- $_ := set $resources $kind $quantities }}
      {{- end }}
      {{- toYaml $resources | nindent 6 }}
    securityContext:
      {{- include "loragate.containerSecurityContext" $root | nindent 6 }}
    volumeMounts:
      - name: dshm
        mountPath: /dev/shm
      - name: tmp
        mountPath: /tmp
      - name: home
        mountPath: /home/vllm
      - name: model-cache
        mountPath: /models
      {{- if $cache }}
      - name: adapter-cache  # what the agent fetched, read by vLLM (and a group's workers) at the same path
        mountPath: /var/cache/adapters
        readOnly: true
        {{- if $v.agent.cacheClaim }}
        subPathExpr: $(ADAPTER_CACHE_GROUP)
        {{- end }}
      {{- end }}
  {{- if $agent }}
  - name: vllm-agent
    image: {{ include "loragate.image" (dict "root" $root "image" $root.Values.image.gateway) }}
    imagePullPolicy: {{ $root.Values.image.gateway.pullPolicy }}
    command: ["loragate"]
    args:
      - vllm-agent
      - --vllm
      - {{ printf "http://127.0.0.1:%v" $v.port }}
      - --host
      - 0.0.0.0
      - --port
      - {{ $v.agent.port | quote }}
      - --adapter-cache-dir
      - /var/cache/adapters
      - --adapter-cache-mb
      - {{ include "loragate.adapterCacheMb" $root | quote }}
      - --adapter-max-mb
      - {{ $root.Values.engine.adapters.maxMb | quote }}
      - --adapter-fetch-timeout-s
      - {{ $root.Values.engine.adapters.fetchTimeoutSeconds | quote }}
      - --adapter-load-wait-s
      - {{ $root.Values.engine.adapters.loadWaitSeconds | quote }}
      - --adapter-source-allow
      {{- range include "loragate.adapterSources" $root | fromJsonArray }}
      - {{ . | quote }}
      {{- end }}
      - --log-level
      - {{ $v.agent.logLevel }}
    {{- $env := include "loragate.sourceEnv" $root | trim }}
    {{- if or $env $v.agent.cacheClaim }}
    env:
      {{- with $env }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- if $v.agent.cacheClaim }}
      - name: ADAPTER_CACHE_GROUP
        valueFrom:
          fieldRef: {fieldPath: {{ $group | quote }}}
      {{- end }}
    {{- end }}
    ports:
      - name: agent
        containerPort: {{ $v.agent.port }}
        protocol: TCP
    readinessProbe:  # ready once vLLM answers its GET /health
      httpGet: {path: /readyz, port: agent}
      periodSeconds: 5
      failureThreshold: 2
    livenessProbe:
      httpGet: {path: /healthz, port: agent}
      periodSeconds: 10
      failureThreshold: 3
    resources:
      {{- toYaml $v.agent.resources | nindent 6 }}
    securityContext:
      {{- include "loragate.containerSecurityContext" $root | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: adapter-cache
        mountPath: /var/cache/adapters
        {{- if $v.agent.cacheClaim }}
        subPathExpr: $(ADAPTER_CACHE_GROUP)
        {{- end }}
  {{- end }}
volumes:
  - name: dshm  # NCCL's and vLLM's shared memory between the tensor-parallel workers
    emptyDir:
      medium: Memory
      sizeLimit: {{ $v.shmSizeLimit }}
  - name: tmp
    emptyDir: {}
  - name: home
    emptyDir: {}
  - name: model-cache
    {{- if $v.modelCache.existingClaim }}
    persistentVolumeClaim:
      claimName: {{ $v.modelCache.existingClaim }}
    {{- else if $v.modelCache.sizeLimit }}
    emptyDir:
      sizeLimit: {{ $v.modelCache.sizeLimit }}
    {{- else }}
    emptyDir: {}
    {{- end }}
  {{- if $cache }}
  - name: adapter-cache
    {{- if $v.agent.cacheClaim }}
    persistentVolumeClaim:
      claimName: {{ $v.agent.cacheClaim }}
    {{- else }}
    emptyDir:  # a pod starts empty and fills it on demand
      sizeLimit: {{ $root.Values.engine.adapters.cache.sizeLimit }}
    {{- end }}
  {{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* ---------------------------------------------------------------- names and labels */}}

{{- define "kvserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* KubeRay derives child names (<name>-raycluster-xxxxx-head-svc, ...) from the
RayService name: keep it short enough for their 63-character limits. */}}
{{- define "kvserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvserve.labels" -}}
helm.sh/chart: {{ include "kvserve.chart" . }}
{{ include "kvserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvserve
{{- end -}}

{{- define "kvserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* ---------------------------------------------------------------- kvserve block */}}

{{- define "kvserve.httpPort" -}}
{{- $http := .Values.kvserve.http | default dict -}}
{{- $http.port | default 8000 | int -}}
{{- end -}}

{{- define "kvserve.grpcPort" -}}
{{- $grpc := .Values.kvserve.grpc | default dict -}}
{{- $grpc.port | default 9000 | int -}}
{{- end -}}

{{/* "true" / "false": the gRPC API is on unless kvserve.grpc.enabled is false. */}}
{{- define "kvserve.grpcEnabled" -}}
{{- $grpc := .Values.kvserve.grpc | default dict -}}
{{- if hasKey $grpc "enabled" -}}{{ ternary "true" "false" (eq (toString $grpc.enabled) "true") }}{{- else -}}true{{- end -}}
{{- end -}}

{{/* gRPC TLS is on when gRPC is and a Secret is named (router/frontend/grpc_api/tls.py reads the env). */}}
{{- define "kvserve.grpcTLS" -}}
{{- and (eq (include "kvserve.grpcEnabled" .) "true") (ne (.Values.grpcTLS.existingSecret | default "") "") -}}
{{- end -}}

{{/* kvserve.ingress.max_body_bytes in bytes: an integer, or a byte size string as
cluster/config_fields.py's parse_bytes reads it ("8MiB", "4MB", "1.5GiB"); unset: the
ingress's default (router/frontend/settings.py, pinned by tests/security/test_grpc_exposure.py).
Serve's gRPC proxy takes it as its message-size cap, so gRPC refuses what HTTP refuses. */}}
{{- define "kvserve.maxBodyBytes" -}}
{{- $ingress := .Values.kvserve.ingress | default dict -}}
{{- $v := $ingress.max_body_bytes -}}
{{- if kindIs "invalid" $v -}}4194304
{{- else if kindIs "string" $v -}}
{{- $number := regexFind `[0-9]+(\.[0-9]+)?` $v | float64 -}}
{{- $unit := regexFind "[A-Za-z]+" $v | upper -}}
{{- $binary := dict "K" 1024 "M" 1048576 "G" 1073741824 "T" 1099511627776 -}}
{{- $decimal := dict "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $scale := 1 -}}
{{- if contains "I" $unit -}}{{- $scale = get $binary (substr 0 1 $unit) -}}
{{- else if and $unit (ne $unit "B") -}}{{- $scale = get $decimal (substr 0 1 $unit) -}}
{{- end -}}
{{- mulf $number $scale | int64 -}}
{{- else -}}{{- $v | int64 -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.tensorParallelSize" -}}
{{- $workers := .Values.kvserve.workers | default dict -}}
{{- $workers.tensor_parallel_size | default 1 | int -}}
{{- end -}}

{{- define "kvserve.appName" -}}
{{- .Values.kvserve.app_name | default "kvserve" -}}
{{- end -}}

{{- define "kvserve.routePrefix" -}}
{{- .Values.kvserve.route_prefix | default "/" -}}
{{- end -}}

{{/* The Serve config: the same document `serve deploy` takes. applications[0].args is
the kvserve block, verbatim (cluster.app:app_builder validates it with KVServeConfig). */}}
{{- define "kvserve.serveConfig" -}}
proxy_location: {{ .Values.serve.proxyLocation }}
http_options:
  host: 0.0.0.0
  port: {{ include "kvserve.httpPort" . }}
  {{- if not (kindIs "invalid" .Values.serve.requestTimeoutS) }}
  request_timeout_s: {{ .Values.serve.requestTimeoutS }}
  {{- end }}
{{- if eq (include "kvserve.grpcEnabled" .) "true" }}
grpc_options:
  port: {{ include "kvserve.grpcPort" . }}
  grpc_servicer_functions:
    - router.frontend.grpc_api.proxy.add_KVServeServicer_to_server
{{- end }}
applications:
  - name: {{ include "kvserve.appName" . }}
    route_prefix: {{ include "kvserve.routePrefix" . }}
    import_path: cluster.app:app_builder
    args:
      {{- include "kvserve.appArgs" . | nindent 6 }}
{{- end -}}

{{/* The kvserve block, plus one thing the chart knows and the app cannot: which pods
belong to which pool. Each worker section (workers, or disaggregation.prefill / .decode)
asks for one unit per tensor-parallel rank of the Ray resource its pool's pods advertise
(`kvserve_pool_<role>`, one unit per GPU), unless it sets `resources` itself; so prefill
replicas land on prefill pods and decode replicas on decode pods. */}}
{{- define "kvserve.appArgs" -}}
{{- $args := deepCopy .Values.kvserve -}}
{{- if .Values.ingressGroup.enabled -}}
  {{- /* The ingress replicas on the ingress group's pods, one per pod (never on GPU hosts) */ -}}
  {{- $ingress := $args.ingress | default dict -}}
  {{- if not (hasKey $ingress "resources") -}}
    {{- $_ := set $ingress "resources" (dict "kvserve_ingress" 1) -}}
  {{- end -}}
  {{- $_ := set $args "ingress" $ingress -}}
{{- end -}}
{{- if $args.disaggregation -}}
  {{- range $role := list "prefill" "decode" -}}
    {{- $section := get $args.disaggregation $role | default dict -}}
    {{- if not (hasKey $section "resources") -}}
      {{- $_ := set $section "resources" (dict (printf "kvserve_pool_%s" $role) 1) -}}
    {{- end -}}
    {{- $_ := set $args.disaggregation $role $section -}}
  {{- end -}}
{{- else -}}
  {{- $workers := $args.workers | default dict -}}
  {{- if not (hasKey $workers "resources") -}}
    {{- $_ := set $workers "resources" (dict "kvserve_pool_mixed" 1) -}}
  {{- end -}}
  {{- $_ := set $args "workers" $workers -}}
{{- end -}}
{{- if $args.models -}}
  {{- $models := list -}}
  {{- range $entry := $args.models -}}
    {{- $models = append $models (include "kvserve.pinnedModel" (dict "entry" $entry "args" $args "pools" $.Values.pools) | fromYaml) -}}
  {{- end -}}
  {{- $_ := set $args "models" $models -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* One entry of kvserve.models with its worker sections pinned to its pools: the pools
that name the model, else the shared ones (no `model`); a section it inherits from the
top level is written into the entry, pinned. Each section asks for
kvserve_pool_<role>[_<model slug>] (one unit per rank) unless it sets `resources`. */}}
{{- define "kvserve.pinnedModel" -}}
{{- $entry := deepCopy .entry -}}
{{- $suffix := "" -}}
{{- range $pool := .pools -}}
  {{- if and $pool.model (eq $pool.model ($entry.name | default "")) -}}
    {{- $suffix = printf "_%s" (include "kvserve.modelSlug" $pool.model) -}}
  {{- end -}}
{{- end -}}
{{- $disagg := $entry.disaggregation | default (deepCopy (.args.disaggregation | default dict)) -}}
{{- if $disagg -}}
  {{- range $role := list "prefill" "decode" -}}
    {{- $section := get $disagg $role | default dict -}}
    {{- if or (not (hasKey $section "resources")) (not (hasKey ($entry.disaggregation | default dict) $role)) -}}
      {{- $_ := set $section "resources" (dict (printf "kvserve_pool_%s%s" $role $suffix) 1) -}}
    {{- end -}}
    {{- $_ := set $disagg $role $section -}}
  {{- end -}}
  {{- $_ := set $entry "disaggregation" $disagg -}}
{{- else -}}
  {{- $workers := $entry.workers | default (deepCopy (.args.workers | default dict)) -}}
  {{- if or (not (hasKey $workers "resources")) (not $entry.workers) -}}
    {{- $_ := set $workers "resources" (dict (printf "kvserve_pool_mixed%s" $suffix) 1) -}}
  {{- end -}}
  {{- $_ := set $entry "workers" $workers -}}
{{- end -}}
{{- toYaml $entry -}}
{{- end -}}

{{/* A model name as it appears in Ray resource names: cluster/models_config.py's slug. */}}
{{- define "kvserve.modelSlug" -}}
{{- regexReplaceAll "[^A-Za-z0-9._-]+" . "-" | trimAll "-" -}}
{{- end -}}

{{/* ---------------------------------------------------------------- validation */}}

{{/* Cross-field rules that values.schema.json cannot state (or states less clearly).
Rendered (as nothing) at the top of rayservice.yaml, so every install/template/lint
runs it. */}}
{{- define "kvserve.validate" -}}
{{- /* workers.tensor_parallel_size: the mixed pool; disaggregated pools are checked per role below */ -}}
{{- $tp := include "kvserve.tensorParallelSize" . | int -}}
{{- $workers := .Values.kvserve.workers | default dict -}}
{{- $names := dict -}}
{{- $roles := dict -}}
{{- $maxGpus := 0 -}}
{{- range $i, $pool := .Values.pools -}}
  {{- if hasKey $names $pool.name -}}
    {{- fail (printf "pools: the name %q is used twice; each pool becomes a KubeRay worker group and needs its own name" $pool.name) -}}
  {{- end -}}
  {{- $_ := set $names $pool.name true -}}
  {{- $_ := set $roles $pool.role true -}}
  {{- $gpus := $pool.gpusPerPod | int -}}
  {{- if gt $gpus $maxGpus -}}{{- $maxGpus = $gpus -}}{{- end -}}
  {{- if and (not $.Values.kvserve.disaggregation) (not $.Values.kvserve.models) (ne (mod $gpus $tp) 0) -}}
    {{- fail (printf "pools[%d] (%s): gpusPerPod=%d is not a multiple of kvserve.workers.tensor_parallel_size=%d; a tensor-parallel group must not span pods" $i $pool.name $gpus $tp) -}}
  {{- end -}}
  {{- if gt ($pool.minReplicas | int) ($pool.maxReplicas | int) -}}
    {{- fail (printf "pools[%d] (%s): minReplicas=%d is greater than maxReplicas=%d" $i $pool.name ($pool.minReplicas | int) ($pool.maxReplicas | int)) -}}
  {{- end -}}
  {{- if or (lt ($pool.replicas | int) ($pool.minReplicas | int)) (gt ($pool.replicas | int) ($pool.maxReplicas | int)) -}}
    {{- fail (printf "pools[%d] (%s): replicas=%d must lie in [minReplicas=%d, maxReplicas=%d]" $i $pool.name ($pool.replicas | int) ($pool.minReplicas | int) ($pool.maxReplicas | int)) -}}
  {{- end -}}
{{- end -}}
{{- if .Values.kvserve.models -}}
  {{- include "kvserve.validateModels" . -}}
{{- else -}}
{{- range $i, $pool := .Values.pools -}}
  {{- if $pool.model -}}
    {{- fail (printf "pools[%d] (%s): `model` names one of kvserve.models, which is not set" $i $pool.name) -}}
  {{- end -}}
{{- end -}}
{{- if or (hasKey $roles "prefill") (hasKey $roles "decode") -}}
  {{- if hasKey $roles "mixed" -}}
    {{- fail "pools: a 'mixed' pool cannot be combined with 'prefill'/'decode' pools; declare either mixed pools, or one prefill and one decode pool (disaggregated)" -}}
  {{- end -}}
  {{- if not (and (hasKey $roles "prefill") (hasKey $roles "decode")) -}}
    {{- fail "pools: disaggregated serving needs both a 'prefill' and a 'decode' pool" -}}
  {{- end -}}
{{- end -}}
{{- $disagg := .Values.kvserve.disaggregation -}}
{{- if and (or (hasKey $roles "prefill") (hasKey $roles "decode")) (not $disagg) -}}
  {{- fail "pools: 'prefill'/'decode' pools need kvserve.disaggregation (its prefill and decode sections configure the two worker deployments that run on them)" -}}
{{- end -}}
{{- if and $disagg (hasKey $roles "mixed") -}}
  {{- fail "kvserve.disaggregation is set but pools has a 'mixed' pool: declare one 'prefill' and one 'decode' pool for the two worker deployments" -}}
{{- end -}}
{{- if $disagg -}}
  {{- range $i, $pool := $.Values.pools -}}
    {{- $section := get $disagg $pool.role | default dict -}}
    {{- $ptp := $section.tensor_parallel_size | default 1 | int -}}
    {{- if ne (mod ($pool.gpusPerPod | int) $ptp) 0 -}}
      {{- fail (printf "pools[%d] (%s): gpusPerPod=%d is not a multiple of kvserve.disaggregation.%s.tensor_parallel_size=%d; a tensor-parallel group must not span pods" $i $pool.name ($pool.gpusPerPod | int) $pool.role $ptp) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- end -}}
{{- $state := .Values.kvserve.state | default dict -}}
{{- if .Values.stateStore.redisPasswordSecret.name -}}
  {{- if not $state.redis_url -}}
    {{- fail "stateStore.redisPasswordSecret.name is set but kvserve.state.redis_url is empty: nothing would use the password; set the URL (redis://HOST:PORT/DB) or drop the Secret" -}}
  {{- end -}}
  {{- if and (hasKey $state "redis_password_env") (not $state.redis_password_env) -}}
    {{- fail "stateStore.redisPasswordSecret.name is set but kvserve.state.redis_password_env is null: the ingress would not read the password; leave it unset (KVSERVE_REDIS_PASSWORD) or name a variable" -}}
  {{- end -}}
{{- end -}}
{{- if not (kindIs "invalid" $workers.num_gpus) -}}
  {{- $numGpus := $workers.num_gpus | float64 -}}
  {{- if gt $numGpus (float64 $maxGpus) -}}
    {{- fail (printf "kvserve.workers.num_gpus=%v is more than any pool's gpusPerPod (%d): no worker replica could be scheduled" $workers.num_gpus $maxGpus) -}}
  {{- end -}}
  {{- if and (gt $tp 1) (lt $numGpus (float64 $tp)) -}}
    {{- fail (printf "kvserve.workers.num_gpus=%v is less than tensor_parallel_size=%d: each replica needs one GPU per tensor-parallel rank" $workers.num_gpus $tp) -}}
  {{- end -}}
{{- end -}}
{{- $ig := .Values.ingressGroup -}}
{{- if $ig.enabled -}}
  {{- $ingress := .Values.kvserve.ingress | default dict -}}
  {{- $numIngress := $ingress.num_replicas | default 1 | int -}}
  {{- $numIngressKey := "num_replicas" -}}
  {{- if $ingress.autoscaling -}}
    {{- $numIngress = $ingress.autoscaling.max_replicas | default 4 | int -}}
    {{- $numIngressKey = "autoscaling.max_replicas" -}}
  {{- end -}}
  {{- if and (not (hasKey $ingress "resources")) (gt $numIngress ($ig.maxReplicas | int)) -}}
    {{- fail (printf "kvserve.ingress.%s=%d is more than ingressGroup.maxReplicas=%d: each ingress replica takes one ingress pod" $numIngressKey $numIngress ($ig.maxReplicas | int)) -}}
  {{- end -}}
  {{- if gt ($ig.minReplicas | int) ($ig.maxReplicas | int) -}}
    {{- fail (printf "ingressGroup: minReplicas=%d is greater than maxReplicas=%d" ($ig.minReplicas | int) ($ig.maxReplicas | int)) -}}
  {{- end -}}
  {{- if or (lt ($ig.replicas | int) ($ig.minReplicas | int)) (gt ($ig.replicas | int) ($ig.maxReplicas | int)) -}}
    {{- fail (printf "ingressGroup: replicas=%d must lie in [minReplicas=%d, maxReplicas=%d]" ($ig.replicas | int) ($ig.minReplicas | int) ($ig.maxReplicas | int)) -}}
  {{- end -}}
  {{- range $pool := .Values.pools -}}
    {{- if eq $pool.name $ig.name -}}
      {{- fail (printf "pools: the name %q is the ingress group's (ingressGroup.name); each KubeRay worker group needs its own name" $pool.name) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- $src := .Values.modelSource -}}
{{- if eq $src.type "pvc" -}}
  {{- if not $src.pvc.claimName -}}
    {{- fail "modelSource.type is 'pvc' but modelSource.pvc.claimName is empty: name the PersistentVolumeClaim that holds the model directory" -}}
  {{- end -}}
{{- else if eq $src.type "hostPath" -}}
  {{- if not $src.hostPath.path -}}
    {{- fail "modelSource.type is 'hostPath' but modelSource.hostPath.path is empty: give the node directory that holds the model" -}}
  {{- end -}}
{{- end -}}
{{- if and (ne $src.type "none") .Values.kvserve.models -}}
  {{- $mount := trimSuffix "/" $src.mountPath -}}
  {{- range $i, $entry := .Values.kvserve.models -}}
    {{- $path := $entry.path | default "" -}}
    {{- if not (or (eq $path $mount) (hasPrefix (printf "%s/" $mount) $path)) -}}
      {{- fail (printf "kvserve.models[%d].path=%q does not lie under modelSource.mountPath=%q: the engine would not find the mounted model (put every model's directory under the mount, or set modelSource.type to 'none')" $i $path $src.mountPath) -}}
    {{- end -}}
  {{- end -}}
{{- else if ne $src.type "none" -}}
  {{- $model := .Values.kvserve.model | default dict -}}
  {{- $path := "" -}}
  {{- if kindIs "string" $model -}}{{- $path = $model -}}{{- else -}}{{- $path = $model.path | default "" -}}{{- end -}}
  {{- $mount := trimSuffix "/" $src.mountPath -}}
  {{- if not (or (eq $path $mount) (hasPrefix (printf "%s/" $mount) $path)) -}}
    {{- fail (printf "kvserve.model.path=%q does not lie under modelSource.mountPath=%q: the engine would not find the mounted model (set kvserve.model.path to %q, or modelSource.type to 'none')" $path $src.mountPath $src.mountPath) -}}
  {{- end -}}
{{- end -}}
{{- if .Values.gcsFaultTolerance.enabled -}}
  {{- if not .Values.gcsFaultTolerance.redisAddress -}}
    {{- fail "gcsFaultTolerance.enabled is true but gcsFaultTolerance.redisAddress is empty (host:port of the Redis that stores the GCS state)" -}}
  {{- end -}}
{{- end -}}
{{- if and (eq .Values.rayAuth.mode "secret") (not .Values.rayAuth.existingSecret) -}}
  {{- fail "rayAuth.mode is 'secret' but rayAuth.existingSecret is empty: name the Secret that holds the Ray auth token" -}}
{{- end -}}
{{- /* Secure by default: no keys only when the values say so. */ -}}
{{- if and .Values.apiKeys.required (not .Values.apiKeys.existingSecret) -}}
  {{- fail "apiKeys.existingSecret is empty: the OpenAI/gRPC APIs would accept any caller. Create a Secret with the keys (kubectl create secret generic kvserve-api-keys --from-literal=api-keys=KEY1,KEY2) and set apiKeys.existingSecret=kvserve-api-keys, or set apiKeys.required=false to serve without API keys" -}}
{{- end -}}
{{- $ingressCfg := .Values.kvserve.ingress | default dict -}}
{{- if and .Values.serviceMonitor.enabled .Values.apiKeys.existingSecret (not $ingressCfg.metrics_public) (not .Values.serviceMonitor.bearerTokenSecret.name) -}}
  {{- fail "serviceMonitor.enabled with API keys on: /metrics needs a key. Set serviceMonitor.bearerTokenSecret.name (a Secret whose key serviceMonitor.bearerTokenSecret.key holds one plaintext API key), or make /metrics public explicitly with kvserve.ingress.metrics_public=true" -}}
{{- end -}}
{{- end -}}

{{/* kvserve.models: every pool's `model` names a model, and every model has the pools
its worker deployments need (its own, else the shared ones without `model`): a mixed pool,
or a prefill and a decode pool when it is disaggregated; each of them holds whole
tensor-parallel groups of the section that runs there. */}}
{{- define "kvserve.validateModels" -}}
{{- $top := .Values.kvserve -}}
{{- $names := dict -}}
{{- range $entry := $top.models -}}{{- $_ := set $names ($entry.name | default "") true -}}{{- end -}}
{{- range $i, $pool := .Values.pools -}}
  {{- if and $pool.model (not (hasKey $names $pool.model)) -}}
    {{- fail (printf "pools[%d] (%s): model %q is not the name of one of kvserve.models" $i $pool.name $pool.model) -}}
  {{- end -}}
{{- end -}}
{{- range $entry := $top.models -}}
  {{- $name := $entry.name | default "" -}}
  {{- $own := list -}}
  {{- $shared := list -}}
  {{- range $pool := $.Values.pools -}}
    {{- if eq ($pool.model | default "") $name -}}{{- $own = append $own $pool -}}{{- end -}}
    {{- if not $pool.model -}}{{- $shared = append $shared $pool -}}{{- end -}}
  {{- end -}}
  {{- $pools := ternary $own $shared (gt (len $own) 0) -}}
  {{- $disagg := $entry.disaggregation | default ($top.disaggregation | default dict) -}}
  {{- $sections := dict "mixed" ($entry.workers | default ($top.workers | default dict)) -}}
  {{- if $disagg -}}{{- $sections = dict "prefill" ($disagg.prefill | default dict) "decode" ($disagg.decode | default dict) -}}{{- end -}}
  {{- range $role, $section := $sections -}}
    {{- $found := false -}}
    {{- $tp := $section.tensor_parallel_size | default 1 | int -}}
    {{- range $pool := $pools -}}
      {{- if eq $pool.role $role -}}
        {{- $found = true -}}
        {{- if ne (mod ($pool.gpusPerPod | int) $tp) 0 -}}
          {{- fail (printf "pools (%s): gpusPerPod=%d is not a multiple of model %q's tensor_parallel_size=%d; a tensor-parallel group must not span pods" $pool.name ($pool.gpusPerPod | int) $name $tp) -}}
        {{- end -}}
      {{- end -}}
    {{- end -}}
    {{- if not $found -}}
      {{- fail (printf "kvserve.models: model %q has no %q pool: give a pool `model: %s` and `role: %s`, or keep a shared %s pool (no `model`)" $name $role $name $role $role) -}}
    {{- end -}}
  {{- end -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- pod pieces */}}

{{- define "kvserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
# Only chown the model volume when its root does not match (a model PVC holds many GBs).
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvserve.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .Values.securityContext.readOnlyRootFilesystem }}
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Env common to every Ray container. Writable caches go to /tmp (an emptyDir), so the
root filesystem can stay read-only. */}}
{{- define "kvserve.env" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: HF_HOME
  value: /tmp/cache/huggingface
- name: HF_HUB_OFFLINE
  value: {{ ternary "0" "1" (eq .Values.modelSource.type "none") | quote }}
- name: TRITON_CACHE_DIR
  value: /tmp/cache/triton
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: {{ ternary "1" "0" .Values.serve.throughputOptimized | quote }}
{{- $http := .Values.kvserve.http | default dict }}
{{- if $http.direct_ingress }}
{{- /* Serve's direct ingress (kvserve.http.direct_ingress; cluster/serve_env.py DirectIngress) */}}
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "1"
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_HAPROXY_STATS_PORT
  value: {{ $http.haproxy_stats_port | default 8404 | quote }}
- name: RAY_SERVE_HAPROXY_METRICS_PORT
  value: {{ $http.haproxy_metrics_port | default 9101 | quote }}
{{- else }}
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "0"
{{- end }}
{{- if eq .Values.rayAuth.mode "secret" }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.rayAuth.existingSecret }}
      key: {{ .Values.rayAuth.key }}
{{- end }}
{{- if eq (include "kvserve.grpcTLS" .) "true" }}
{{- $tls := .Values.grpcTLS }}
- name: KVSERVE_GRPC_TLS_PORT
  value: {{ $tls.port | quote }}
- name: KVSERVE_GRPC_TLS_CERT_FILE
  value: /etc/kvserve/grpc-tls/{{ $tls.certKey }}
- name: KVSERVE_GRPC_TLS_KEY_FILE
  value: /etc/kvserve/grpc-tls/{{ $tls.keyKey }}
{{- if $tls.clientCAKey }}
- name: KVSERVE_GRPC_TLS_CLIENT_CA_FILE
  value: /etc/kvserve/grpc-tls/{{ $tls.clientCAKey }}
{{- end }}
{{- end }}
{{- if eq (include "kvserve.grpcEnabled" .) "true" }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ include "kvserve.maxBodyBytes" . | quote }}
- name: KVSERVE_APP_NAME
  value: {{ include "kvserve.appName" . | quote }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
- name: KVSERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.existingSecret }}
      key: {{ .Values.apiKeys.key }}
{{- end }}
{{- if .Values.apiKeys.adminSecret }}
- name: KVSERVE_ADMIN_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.adminSecret }}
      key: {{ .Values.apiKeys.adminKey }}
{{- end }}
{{- if .Values.stateStore.redisPasswordSecret.name }}
- name: {{ include "kvserve.redisPasswordEnv" . }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.stateStore.redisPasswordSecret.name }}
      key: {{ .Values.stateStore.redisPasswordSecret.key }}
{{- end }}
{{- end -}}

{{/* The env var the ingress reads the state store's Redis password from
(kvserve.state.redis_password_env, cluster/config.py's default otherwise). */}}
{{- define "kvserve.redisPasswordEnv" -}}
{{- $state := .Values.kvserve.state | default dict -}}
{{- if hasKey $state "redis_password_env" -}}{{ $state.redis_password_env }}{{- else -}}KVSERVE_REDIS_PASSWORD{{- end -}}
{{- end -}}

{{- define "kvserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.modelSource.type "none" }}
- name: model
  mountPath: {{ .Values.modelSource.mountPath }}
  readOnly: true
  {{- if and (eq .Values.modelSource.type "pvc") .Values.modelSource.pvc.subPath }}
  subPath: {{ .Values.modelSource.pvc.subPath }}
  {{- end }}
{{- end }}
{{- if eq (include "kvserve.grpcTLS" .) "true" }}
- name: grpc-tls
  mountPath: /etc/kvserve/grpc-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvserve.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.securityContext.tmpSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.securityContext.shmSizeLimit }}
{{- if eq .Values.modelSource.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.modelSource.pvc.claimName }}
    readOnly: {{ not .Values.modelSource.initContainer.enabled }}
{{- else if eq .Values.modelSource.type "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.modelSource.hostPath.path }}
    type: {{ .Values.modelSource.hostPath.type }}
{{- end }}
{{- if eq (include "kvserve.grpcTLS" .) "true" }}
- name: grpc-tls
  secret:
    secretName: {{ .Values.grpcTLS.existingSecret }}
    defaultMode: 0400
{{- end }}
{{- end -}}

{{- define "kvserve.initContainers" -}}
{{- $init := .Values.modelSource.initContainer -}}
{{- if and $init.enabled (ne .Values.modelSource.type "none") }}
- name: model-init
  image: {{ default (include "kvserve.image" .) $init.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- with $init.command }}
  command: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $init.args }}
  args: {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: MODEL_DIR
      value: {{ .Values.modelSource.mountPath }}
    - name: HOME
      value: /tmp
    {{- with $init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $init.resources }}
  resources: {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext: {{- include "kvserve.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: model
      mountPath: {{ .Values.modelSource.mountPath }}
      {{- if and (eq .Values.modelSource.type "pvc") .Values.modelSource.pvc.subPath }}
      subPath: {{ .Values.modelSource.pvc.subPath }}
      {{- end }}
{{- end }}
{{- end -}}

{{/* Container ports of a Ray pod that serves traffic (the Serve proxy runs on it). */}}
{{- define "kvserve.servePorts" -}}
- name: serve
  containerPort: {{ include "kvserve.httpPort" . }}
  protocol: TCP
{{- if eq (include "kvserve.grpcEnabled" .) "true" }}
- name: grpc
  containerPort: {{ include "kvserve.grpcPort" . }}
  protocol: TCP
{{- end }}
{{- if eq (include "kvserve.grpcTLS" .) "true" }}
- name: grpc-tls
  containerPort: {{ .Values.grpcTLS.port }}
  protocol: TCP
{{- end }}
- name: metrics
  containerPort: 8080
  protocol: TCP
{{- end -}}

{{/* The ingress group's pods: one unit of kvserve_ingress each (JSON, for --resources). */}}
{{- define "kvserve.ingressResources" -}}
{{- toJson (dict "kvserve_ingress" 1) -}}
{{- end -}}

{{/* The pods the client-facing Services send to: the ingress group's when it is on (a
GPU host's proxy dies with the host), else every pod with a healthy proxy. */}}
{{- define "kvserve.clientProxySelector" -}}
{{ include "kvserve.selectorLabels" . }}
ray.io/serve: "true"
{{- if .Values.ingressGroup.enabled }}
kvserve.io/client-proxy: "true"
{{- end }}
{{- end -}}

{{/* `ray start --resources` takes a JSON object; KubeRay wants it as a quoted string. */}}
{{- define "kvserve.poolResources" -}}
{{- $suffix := ternary (printf "_%s" (include "kvserve.modelSlug" (.model | default ""))) "" (not (empty .model)) -}}
{{- $res := dict (printf "kvserve_pool_%s%s" .role $suffix) (.gpusPerPod | int) -}}
{{- toJson $res | quote -}}
{{- end -}}

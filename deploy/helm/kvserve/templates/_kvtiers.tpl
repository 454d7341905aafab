{{/* Volumes, env and checks of the KV tiers below the device (values.yaml kvTiers,
docs/kv-tiers.md). Only the worker pods (pools) mount them: only engines use the tiers. */}}

{{/* kvserve.engine.disk_kv_cache_bytes as an integer byte count: an integer, or a string
"<n>[KMGT][i][B]" (cluster/config_fields.py parse_bytes); the engine's default otherwise. */}}
{{- define "kvserve.diskTierBytes" -}}
{{- $engine := .Values.kvserve.engine | default dict -}}
{{- $v := $engine.disk_kv_cache_bytes | default 17179869184 -}}
{{- if kindIs "string" $v -}}
  {{- $s := trim $v -}}
  {{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $s -}}
  {{- $unit := regexReplaceAll "^[0-9]+(\\.[0-9]+)?\\s*" $s "" | upper -}}
  {{- $scale := 1.0 -}}
  {{- if and $unit (ne $unit "B") -}}
    {{- $power := add1 (index (dict "K" 0 "M" 1 "G" 2 "T" 3) (substr 0 1 $unit)) -}}
    {{- $base := ternary 1024.0 1000.0 (contains "I" $unit) -}}
    {{- range until (int $power) -}}{{- $scale = mulf $scale $base -}}{{- end -}}
  {{- end -}}
  {{- mulf (float64 $num) $scale | int64 -}}
{{- else -}}
  {{- $v | int64 -}}
{{- end -}}
{{- end -}}

{{/* The disk tier volume's size in MiB: the bound plus an eighth, rounded up. */}}
{{- define "kvserve.diskTierVolumeMi" -}}
{{- $bytes := include "kvserve.diskTierBytes" . | float64 -}}
{{- divf (mulf $bytes 1.125) 1048576.0 | ceil | int64 -}}
{{- end -}}

{{- define "kvserve.kvTiers.validate" -}}
{{- $engine := .Values.kvserve.engine | default dict -}}
{{- with $engine.disk_kv_cache_dir -}}
  {{- $dir := clean . -}}
  {{- if not (isAbs $dir) -}}
    {{- fail (printf "kvserve.engine.disk_kv_cache_dir=%q must be an absolute path (the chart mounts the disk tier's own volume there)" .) -}}
  {{- end -}}
  {{- $model := clean $.Values.modelSource.mountPath -}}
  {{- if or (has $dir (list "/" "/tmp" "/dev/shm" $model)) (hasPrefix "/dev/shm/" $dir) (hasPrefix (printf "%s/" $model) $dir) -}}
    {{- fail (printf "kvserve.engine.disk_kv_cache_dir=%q overlaps /, /tmp, /dev/shm or the model's mount: give the disk tier a directory of its own (e.g. /var/cache/kvserve); the chart mounts a volume sized to disk_kv_cache_bytes there" .) -}}
  {{- end -}}
{{- end -}}
{{- with $engine.shared_kv_store_dir -}}
  {{- if not (isAbs (clean .)) -}}
    {{- fail (printf "kvserve.engine.shared_kv_store_dir=%q must be an absolute path" .) -}}
  {{- end -}}
  {{- if not $.Values.kvTiers.sharedStore.claimName -}}
    {{- fail "kvserve.engine.shared_kv_store_dir is set but kvTiers.sharedStore.claimName is empty: name a ReadWriteMany PersistentVolumeClaim that every worker pod mounts there" -}}
  {{- end -}}
  {{- if not $.Values.kvTiers.sharedStore.keySecret.name -}}
    {{- fail "kvserve.engine.shared_kv_store_dir is set but kvTiers.sharedStore.keySecret.name is empty: name a Secret holding the store's key (every entry is authenticated with it)" -}}
  {{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvserve.kvTiers.env" -}}
{{- $engine := .Values.kvserve.engine | default dict -}}
{{- if and $engine.shared_kv_store_dir .Values.kvTiers.sharedStore.keySecret.name }}
- name: {{ $engine.kv_store_key_env | default "KVSERVE_KV_STORE_KEY" }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kvTiers.sharedStore.keySecret.name }}
      key: {{ .Values.kvTiers.sharedStore.keySecret.key }}
{{- end }}
{{- end -}}

{{- define "kvserve.kvTiers.volumeMounts" -}}
{{- $engine := .Values.kvserve.engine | default dict -}}
{{- with $engine.disk_kv_cache_dir }}
- name: kv-disk-tier
  mountPath: {{ clean . }}
{{- end }}
{{- with $engine.shared_kv_store_dir }}
- name: kv-shared-store
  mountPath: {{ clean . }}
{{- end }}
{{- end -}}

{{- define "kvserve.kvTiers.volumes" -}}
{{- $engine := .Values.kvserve.engine | default dict -}}
{{- if $engine.disk_kv_cache_dir }}
- name: kv-disk-tier
  emptyDir:
    sizeLimit: {{ include "kvserve.diskTierVolumeMi" . }}Mi
{{- end }}
{{- if $engine.shared_kv_store_dir }}
- name: kv-shared-store
  persistentVolumeClaim:
    claimName: {{ .Values.kvTiers.sharedStore.claimName }}
{{- end }}
{{- end -}}

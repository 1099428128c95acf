{{/*
Names, labels and the checks every template runs first. The node pod's services and their command lines follow
launcher/topology.py (what `kvserve compose` renders); tests/deploy/test_helm_chart.py compares the two.
*/}}

{{- define "kvserve.name" -}}
{{- default "kvserve" .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* 40 characters at most: the StatefulSet's name (this + "-node") must leave room for its pods' revision label. */}}
{{- define "kvserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := include "kvserve.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvserve.nodeName" -}}
{{- include "kvserve.fullname" . }}-node
{{- end }}

{{- define "kvserve.eppName" -}}
{{- include "kvserve.fullname" . }}-epp
{{- end }}

{{- define "kvserve.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "kvserve.fullname" .)) }}
{{- end }}

{{/* (dict "context" $ "component" "node") */}}
{{- define "kvserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvserve.name" .context }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvserve.labels" -}}
{{ include "kvserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .context.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .context.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .context.Chart.Name .context.Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "kvserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/* The node pod's DNS name through the headless Service: (dict "context" $ "index" 0). */}}
{{- define "kvserve.nodeHost" -}}
{{- $node := include "kvserve.nodeName" .context -}}
{{ $node }}-{{ .index }}.{{ $node }}.{{ .context.Release.Namespace }}.svc.{{ .context.Values.clusterDomain }}
{{- end }}

{{/* The kvserve containers run as the image's user (uid 1000), as in compose. */}}
{{- define "kvserve.securityContext" -}}
runAsUser: 1000
runAsGroup: 1000
runAsNonRoot: true
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end }}

{{/* A whole number of at least `min`: (dict "name" "gpusPerNode" "value" .Values.gpusPerNode "min" 1). */}}
{{- define "kvserve.checkCount" -}}
{{- $text := toString .value }}
{{- if or (not (regexMatch "^[0-9]+$" $text)) (lt (int .value) (int .min)) }}
{{- fail (printf "%s must be a whole number of at least %d, got %s" .name (int .min) $text) }}
{{- end }}
{{- end }}

{{/* Every pod port of the node, "name=port" a line: the checks find two services given one port. */}}
{{- define "kvserve.nodePorts" -}}
{{- $p := .Values.ports }}
{{- $ranks := int .Values.gpusPerNode }}
{{- $ep := int .Values.expertParallel }}
redis={{ int $p.redis }}
kvstore={{ int $p.kvstore }}
kvstore metrics={{ int $p.kvstoreMetrics }}
router={{ int $p.router }}
router metrics={{ int $p.routerMetrics }}
gateway={{ int $p.gateway }}
{{- if .Values.kvEvents.enabled }}
kvstore KV events={{ int $p.kvstoreKvEvents }}
kvstore KV events replay={{ add (int $p.kvstoreKvEvents) 1 }}
{{- end }}
{{- range $i := until $ranks }}
rank {{ $i }}={{ add (int $p.rankWorker) $i }}
rank {{ $i }} metrics={{ add (int $p.rankWorkerMetrics) $i }}
{{- if $.Values.kvEvents.enabled }}
rank {{ $i }} KV events={{ add (int $p.rankKvEvents) (mul 2 $i) }}
rank {{ $i }} KV events replay={{ add (int $p.rankKvEvents) (mul 2 $i) 1 }}
{{- end }}
{{- if and (gt $ep 1) (eq (mod $i $ep) 0) }}
expert-parallel group ep-{{ $i }} rendezvous={{ add (int $p.expertParallelRendezvous) $i }}
{{- end }}
{{- end }}
{{- end }}

{{/* The config keys the chart sets itself (or that each container gets in its environment). */}}
{{- define "kvserve.chartConfigKeys" -}}
model served_model_name device l1_host_gb l1_arena_dir kvstore_host kvstore_port kvstore router_host router_port
router redis_url redis_password_file rank_worker_host rank_worker_port rank_id rank_advertise_address rank_workers
expert_parallel_size expert_parallel_rank expert_parallel_rendezvous expert_parallel_group kvstore_metrics_port
router_metrics_port rank_worker_metrics_port kv_events_endpoint kv_events_replay_endpoint kvstore_kv_events_endpoint
kvstore_kv_events_replay_endpoint internal_secret_file gateway_host gateway_port api_keys_file
{{- end }}

{{- define "kvserve.validate" -}}
{{- include "kvserve.checkCount" (dict "name" "nodes" "value" .Values.nodes "min" 1) }}
{{- include "kvserve.checkCount" (dict "name" "gpusPerNode" "value" .Values.gpusPerNode "min" 1) }}
{{- include "kvserve.checkCount" (dict "name" "expertParallel" "value" .Values.expertParallel "min" 1) }}
{{- include "kvserve.checkCount" (dict "name" "epp.replicas" "value" .Values.epp.replicas "min" 1) }}
{{- include "kvserve.checkCount" (dict "name" "rankStartupSeconds" "value" .Values.rankStartupSeconds "min" 10) }}
{{- $ranks := int .Values.gpusPerNode }}
{{- $ep := int .Values.expertParallel }}
{{- if mod $ranks $ep }}
{{- fail (printf "gpusPerNode %d does not split into expert-parallel groups of %d: expertParallel must divide gpusPerNode" $ranks $ep) }}
{{- end }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?$" (toString .Values.l1SizeGb)) }}
{{- fail (printf "l1SizeGb must be a number of GB, 0 or more, got %v" .Values.l1SizeGb) }}
{{- end }}
{{- $ports := dict }}
{{- range $line := splitList "\n" (include "kvserve.nodePorts" .) }}
{{- if $line }}
{{- $name := regexReplaceAll "=[^=]*$" $line "" }}
{{- $port := regexReplaceAll "^.*=" $line "" }}
{{- if or (lt (int $port) 1) (gt (int $port) 65535) }}
{{- fail (printf "the node pod's %s port %s is not a port (1-65535): see ports in the values" $name $port) }}
{{- end }}
{{- if hasKey $ports $port }}
{{- fail (printf "the node pod's %s and %s would both listen on port %s (its containers share one network namespace): change ports in the values" (get $ports $port) $name $port) }}
{{- end }}
{{- $_ := set $ports $port $name }}
{{- end }}
{{- end }}
{{- range $key := splitList " " (include "kvserve.chartConfigKeys" . | replace "\n" " ") }}
{{- if hasKey $.Values.config $key }}
{{- fail (printf "config.%s is set by the chart (from model, servedModelName, l1SizeGb, expertParallel, ports or per container): remove it from config" $key) }}
{{- end }}
{{- end }}
{{- range $key := list "listen" "health_listen" "metrics_listen" "policy" "node_api_key_file" "nodes" }}
{{- if hasKey $.Values.epp.fleet $key }}
{{- fail (printf "epp.fleet.%s is set by the chart: remove it from epp.fleet" $key) }}
{{- end }}
{{- end }}
{{- if not .Values.secrets.existingSecret }}
{{- $internal := .Values.secrets.internalSecret | default "" }}
{{- if not (regexMatch "^[!-~]{32,}$" $internal) }}
{{- fail "secrets.internalSecret must be 32 or more printable characters without spaces (kvserve secret create), or name a Secret in secrets.existingSecret" }}
{{- end }}
{{- $_ := required "secrets.redisPassword is required when secrets.existingSecret is empty" .Values.secrets.redisPassword }}
{{- $_ := required "secrets.apiKeys (the gateway's key file: --set-file secrets.apiKeys=kvserve-keys.json) is required when secrets.existingSecret is empty" .Values.secrets.apiKeys }}
{{- $_ := required "secrets.metricsApiKey (a key with the metrics scope: kvserve keys create --metrics) is required when secrets.existingSecret is empty" .Values.secrets.metricsApiKey }}
{{- end }}
{{- if and .Values.httpRoute.enabled (not .Values.inferencePool.enabled) }}
{{- fail "httpRoute.enabled needs inferencePool.enabled: the route's backend is the InferencePool" }}
{{- end }}
{{- if .Values.httpRoute.enabled }}
{{- $_ := required "httpRoute.gateway.name: the Gateway the route attaches to" .Values.httpRoute.gateway.name }}
{{- end }}
{{- end }}

{{/* Names and labels. */}}
{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name; kept short (40) because KubeRay derives cluster, pod and service names from it. */}}
{{- define "loraplex.fullname" -}}
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

{{- define "loraplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ include "loraplex.chart" . }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplex
{{- end -}}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "loraplex.tenantsSecretName" -}}
{{- default (printf "%s-tenants" (include "loraplex.fullname" .)) .Values.tenants.existingSecret -}}
{{- end -}}

{{/* Mount points shared by the pod template and the Serve config. */}}
{{- define "loraplex.adapterCacheDir" -}}/var/cache/loraplex{{- end -}}
{{- define "loraplex.modelsDir" -}}/models{{- end -}}

{{/*
The Serve config (serveConfigV2) as one structure rendered by toYaml: `args` is the
app.config.AppConfig of app.main:build_app.
*/}}
{{- define "loraplex.serveConfig" -}}
{{- $args := dict
  "store_uri" .Values.store.uri
  "tenants_file" (printf "%s/%s" .Values.tenants.mountPath .Values.tenants.key)
  "cache_dir" (include "loraplex.adapterCacheDir" .)
  "cache_max_bytes" .Values.adapterCache.maxBytes
  "engine" .Values.engine
  "engine_deployment" .Values.engineDeployment
  "gateway_deployment" .Values.gatewayDeployment
  "observability" .Values.observability -}}
{{- if .Values.store.endpointUrl -}}
{{- $_ := set $args "s3_endpoint_url" .Values.store.endpointUrl -}}
{{- end -}}
{{- with .Values.store.s3 -}}
{{- $_ := set $args "s3" . -}}
{{- end -}}
{{- $app := dict "name" "loraplex" "route_prefix" "/" "import_path" "app.main:build_app" "args" $args -}}
{{- with .Values.serve.deployments -}}
{{- $_ := set $app "deployments" . -}}
{{- end -}}
{{- if .Values.serve.runtimeEnvVars -}}
{{- $_ := set $app "runtime_env" (dict "env_vars" .Values.serve.runtimeEnvVars) -}}
{{- end -}}
{{- $cfg := dict
  "proxy_location" .Values.serve.proxyLocation
  "http_options" (dict "host" "0.0.0.0" "port" .Values.serve.port)
  "applications" (list $app) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
Capacity check: the engine's autoscaling ceiling must fit the GPUs the worker groups may get.
*/}}
{{- define "loraplex.checkCapacity" -}}
{{- $gpus := 0 -}}
{{- range .Values.workerGroups -}}
{{- $gpus = add $gpus (mul .maxReplicas .gpusPerPod) -}}
{{- end -}}
{{- $tp := int (default 1 .Values.engine.tensor_parallel_size) -}}
{{- $max := 0 -}}
{{- if .Values.engineDeployment.autoscaling_config -}}
{{- $max = int (default 1 .Values.engineDeployment.autoscaling_config.max_replicas) -}}
{{- else -}}
{{- $max = int (default 1 .Values.engineDeployment.num_replicas) -}}
{{- end -}}
{{- if gt (mul $max $tp) $gpus -}}
{{- fail (printf "engineDeployment allows %d replicas x tensor_parallel_size %d = %d GPUs, but workerGroups can provide at most %d (sum of maxReplicas x gpusPerPod)" $max $tp (mul $max $tp) $gpus) -}}
{{- end -}}
{{- end -}}

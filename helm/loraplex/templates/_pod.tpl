{{/*
A Ray pod template. Call with (dict "root" $ "role" "head"|"worker" "group" <workerGroup or head values>).
Head and workers share the image, env, tenants mount and security settings; GPU workers add
nvidia.com/gpu, /dev/shm, the model cache and the adapter cache.
*/}}
{{- define "loraplex.podTemplate" -}}
{{- $root := .root -}}
{{- $g := .group -}}
{{- $worker := eq .role "worker" -}}
metadata:
  labels:
    {{- include "loraplex.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ ternary "worker" "head" $worker }}
    {{- if $worker }}
    loraplex.io/worker-group: {{ $g.name }}
    {{- end }}
  {{- with $g.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "loraplex.serviceAccountName" $root }}
  {{- if $worker }}
  automountServiceAccountToken: false   # only the head's autoscaler talks to the API server
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-worker" "ray-head" $worker }}
      image: {{ include "loraplex.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      securityContext:
        {{- toYaml $root.Values.containerSecurityContext | nindent 8 }}
      ports:
        {{- if not $worker }}
        - {containerPort: 6379, name: gcs-server}
        - {containerPort: 8265, name: dashboard}
        - {containerPort: 10001, name: client}
        {{- end }}
        - {containerPort: {{ $root.Values.serve.port }}, name: serve}
        - {containerPort: 8080, name: metrics}
      env:
        - {name: LORAPLEX_HOME, value: /var/lib/loraplex}
        - {name: HF_HOME, value: {{ include "loraplex.modelsDir" $root }}/hf}
        {{- if eq (default "haproxy" $root.Values.serve.proxy) "haproxy" }}
        - {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}
        - {name: RAY_SERVE_THROUGHPUT_OPTIMIZED, value: "1"}
        - {name: RAY_SERVE_HAPROXY_TUNE_BUFSIZE, value: {{ $root.Values.serve.haproxyBufsize | int | quote }}}
        {{- end }}
        {{- if $root.Values.model.offline }}
        - {name: HF_HUB_OFFLINE, value: "1"}
        {{- end }}
        {{- with $root.Values.store.endpointUrl }}
        - {name: AWS_ENDPOINT_URL, value: {{ . | quote }}}
        {{- end }}
        {{- with $root.Values.store.region }}
        - {name: AWS_REGION, value: {{ . | quote }}}
        {{- end }}
        {{- with $root.Values.model.hfTokenSecret }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef: {name: {{ . }}, key: HF_TOKEN}
        {{- end }}
        {{- with $root.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $root.Values.store.credentialsSecret }}
      envFrom:
        - secretRef:
            name: {{ . }}
      {{- end }}
      resources:
        {{- $res := deepCopy $g.resources -}}
        {{- if $worker -}}
        {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (toString $g.gpusPerPod)) (default (dict) $res.limits)) -}}
        {{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (toString $g.gpusPerPod)) (default (dict) $res.requests)) -}}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      volumeMounts:
        - {name: tenants, mountPath: {{ $root.Values.tenants.mountPath }}, readOnly: true}
        - {name: loraplex-home, mountPath: /var/lib/loraplex}
        - {name: tmp, mountPath: /tmp}
        - {name: dshm, mountPath: /dev/shm}
        {{- if $worker }}
        - {name: models, mountPath: {{ include "loraplex.modelsDir" $root }}}
        - {name: adapter-cache, mountPath: {{ include "loraplex.adapterCacheDir" $root }}}
        {{- end }}
  volumes:
    - name: tenants
      secret:
        secretName: {{ include "loraplex.tenantsSecretName" $root }}
        defaultMode: 0440
    - name: loraplex-home
      emptyDir: {}
    - name: tmp
      emptyDir: {}
    - name: dshm
      emptyDir: {medium: Memory, sizeLimit: {{ $g.shmSize }}}
    {{- if $worker }}
    - name: adapter-cache
      emptyDir: {sizeLimit: {{ $root.Values.adapterCache.sizeLimit }}}
    - name: models
      {{- if $root.Values.model.cache.existingClaim }}
      persistentVolumeClaim: {claimName: {{ $root.Values.model.cache.existingClaim }}}
      {{- else }}
      emptyDir: {sizeLimit: {{ $root.Values.model.cache.sizeLimit }}}
      {{- end }}
    {{- end }}
{{- end -}}

{{/*
Names, labels, images and the environment every Loopline container shares.
*/}}

{{- define "loopline.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release-scoped base name; components append "-<component>", so keep room for it. */}}
{{- define "loopline.fullname" -}}
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

{{- define "loopline.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Usage: include "loopline.componentName" (dict "root" $ "component" "gateway") */}}
{{- define "loopline.componentName" -}}
{{- printf "%s-%s" (include "loopline.fullname" .root) .component -}}
{{- end -}}

{{/* Usage: include "loopline.selectorLabels" (dict "root" $ "component" "gateway") */}}
{{- define "loopline.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loopline.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Usage: include "loopline.labels" (dict "root" $ "component" "gateway") */}}
{{- define "loopline.labels" -}}
helm.sh/chart: {{ include "loopline.chart" .root }}
{{ include "loopline.selectorLabels" . }}
app.kubernetes.io/part-of: loopline
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/*
A Loopline image reference. Usage: include "loopline.image" (dict "root" $ "image" .Values.gateway.image)
The tag falls back to image.tag, then to the chart's appVersion.
*/}}
{{- define "loopline.image" -}}
{{- $tag := .image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- if .root.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" .root.Values.image.registry) .image.repository (toString $tag) -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (toString $tag) -}}
{{- end -}}
{{- end -}}

{{/* The first deployment's model (the trainer's default base model) and the name it is served under
(the gateway's default model). */}}
{{- define "loopline.defaultModel" -}}
{{- (first .Values.inference.deployments).model | default .Values.model -}}
{{- end -}}

{{- define "loopline.defaultServedModel" -}}
{{- (first .Values.inference.deployments).servedModelName | default (include "loopline.defaultModel" .) -}}
{{- end -}}

{{- define "loopline.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s:4222" (include "loopline.componentName" (dict "root" . "component" "nats")) -}}
{{- else -}}
{{- required "nats.externalUrl is required when nats.enabled is false" .Values.nats.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* The Secret that holds the built-in PostgreSQL's password (key "password"). */}}
{{- define "loopline.postgresSecretName" -}}
{{- if .Values.postgres.existingSecret -}}
{{- .Values.postgres.existingSecret -}}
{{- else -}}
{{- include "loopline.componentName" (dict "root" . "component" "postgres") -}}
{{- end -}}
{{- end -}}

{{/*
The password for the chart's own PostgreSQL Secret: the value given, else the one already in the
cluster (so upgrades keep it), else a new random one.
*/}}
{{- define "loopline.postgresPassword" -}}
{{- include "loopline.keptSecret" (dict "root" . "secret" (include "loopline.postgresSecretName" .) "key" "password" "value" .Values.postgres.password "length" 32) -}}
{{- end -}}

{{/*
"true" when the gateway wants API keys: always, unless gateway.apiKeys.allowOpenGateway is set and no
keys are given; an opt-out beside keys is refused, so it never silently means one or the other.
*/}}
{{- define "loopline.gatewayKeyed" -}}
{{- $keys := .Values.gateway.apiKeys -}}
{{- if not $keys.allowOpenGateway -}}
true
{{- else if or $keys.keys $keys.existingSecret -}}
{{- fail "gateway.apiKeys.allowOpenGateway is true, but gateway.apiKeys.keys or existingSecret is set too: choose one" -}}
{{- end -}}
{{- end -}}

{{/* The Secret that holds the gateway's API keys: yours, else the chart's. */}}
{{- define "loopline.apiKeysSecretName" -}}
{{- .Values.gateway.apiKeys.existingSecret | default (include "loopline.componentName" (dict "root" . "component" "api-keys")) -}}
{{- end -}}

{{/* The Secret that holds the chart's NATS passwords (a key per role). */}}
{{- define "loopline.natsSecretName" -}}
{{- .Values.nats.auth.existingSecret | default (include "loopline.componentName" (dict "root" . "component" "nats")) -}}
{{- end -}}

{{/*
A random secret kept across upgrades: the value given, else the one already in the cluster, else a
new one (`length` characters, starting with `prefix` when given). Usage:
include "loopline.keptSecret" (dict "root" $ "secret" NAME "key" KEY "value" GIVEN "length" N ["prefix" P])
*/}}
{{- define "loopline.keptSecret" -}}
{{- if .value -}}
{{- .value -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .secret -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- $prefix := .prefix | default "" -}}
{{- printf "%s%s" $prefix (randAlphaNum (sub (.length | int) (len $prefix) | int)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
LOOPLINE_NATS_URL, with credentials when NATS wants them: the chart's NATS with auth puts the
service's own user and password (from its Secret) into the URL (Kubernetes expands
$(NATS_PASSWORD), defined just before); an external NATS takes its URL (credentials and all) from a
Secret or from nats.externalUrl. Usage: include "loopline.natsEnv" (dict "root" $ "role" "gateway")
*/}}
{{- define "loopline.natsEnv" -}}
{{- $root := .root -}}
{{- with .root -}}
{{- if and .Values.nats.enabled .Values.nats.auth.enabled -}}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "loopline.natsSecretName" . }}
      key: {{ $.role }}
- name: LOOPLINE_NATS_URL
  value: {{ printf "nats://%s:$(NATS_PASSWORD)@%s:4222" $.role (include "loopline.componentName" (dict "root" . "component" "nats")) | quote }}
{{- if eq $.role "trainer" }}
# The Tinker session workers it starts get their own, narrower user.
- name: NATS_TINKER_WORKER_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "loopline.natsSecretName" . }}
      key: tinker-worker
- name: LOOPLINE_TINKER_WORKER_NATS_URL
  value: {{ printf "nats://tinker-worker:$(NATS_TINKER_WORKER_PASSWORD)@%s:4222" (include "loopline.componentName" (dict "root" . "component" "nats")) | quote }}
{{- end }}
{{- else if and (not .Values.nats.enabled) .Values.nats.externalUrlSecret.name -}}
- name: LOOPLINE_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.nats.externalUrlSecret.name }}
      key: {{ .Values.nats.externalUrlSecret.key }}
{{- else -}}
- name: LOOPLINE_NATS_URL
  value: {{ include "loopline.natsUrl" . | quote }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Environment shared by every Loopline container but its NATS URL (loopline.natsEnv).
Usage: include "loopline.commonEnv" $ */}}
{{- define "loopline.commonEnv" -}}
- name: LOOPLINE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: LOOPLINE_STATE_DIR
  value: /var/lib/loopline
# Each pod names its replica after itself, so logs, /v1/health and the readiness probe agree.
- name: LOOPLINE_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- with .Values.otlpEndpoint }}
- name: LOOPLINE_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{ include "loopline.metricsEnv" . }}
{{- end -}}

{{/*
LOOPLINE_METRICS_PORT: the fixed port the pod's `metrics` port and scrape annotations name (the
runtime's default, 0, would pick a free port no scraper could know), or -1 (off) with metrics
disabled. The port must differ from the gateway's HTTP port: both listen in the gateway's pod.
*/}}
{{- define "loopline.metricsEnv" -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.gateway.port)) -}}
{{- fail (printf "metrics.port %v is gateway.port too: the gateway's pod would listen on it twice" .Values.metrics.port) -}}
{{- end -}}
- name: LOOPLINE_METRICS_PORT
  value: {{ ternary .Values.metrics.port -1 .Values.metrics.enabled | quote }}
{{- end -}}

{{/* The container port named `metrics` (nothing with metrics disabled). Usage: include "loopline.metricsPort" $ */}}
{{- define "loopline.metricsPort" -}}
{{- if .Values.metrics.enabled -}}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end -}}
{{- end -}}

{{/*
A Loopline pod template's `annotations:` block (empty string when there are none): Prometheus'
scrape annotations for the metrics port, then the given ones (podAnnotations), which win, so a pod
can opt out with prometheus.io/scrape: "false".
Usage: include "loopline.podAnnotations" (dict "root" $ "annotations" .Values.gateway.podAnnotations)
*/}}
{{- define "loopline.podAnnotations" -}}
{{- $out := deepCopy (.annotations | default dict) -}}
{{- $metrics := .root.Values.metrics -}}
{{- if and $metrics.enabled $metrics.scrapeAnnotations -}}
{{- $out = merge $out (dict "prometheus.io/scrape" "true" "prometheus.io/port" (toString $metrics.port) "prometheus.io/path" "/metrics") -}}
{{- end -}}
{{- if $out -}}
annotations:
  {{- toYaml $out | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The component (and Deployment suffix) of an inference.deployments entry: "inference" for the
one without a name, "inference-<name>" for the others. Usage: include "loopline.inferenceComponent" $entry */}}
{{- define "loopline.inferenceComponent" -}}
{{- ternary "inference" (printf "inference-%s" (.name | default "")) (not .name) -}}
{{- end -}}

{{/*
LOOPLINE_DATABASE_URL for the services that keep SQL (queue, trainer): the chart's PostgreSQL with
the password from its Secret, or the URL of yours from a Secret.
*/}}
{{- define "loopline.databaseEnv" -}}
{{- if .Values.postgres.enabled -}}
- name: POSTGRES_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "loopline.postgresSecretName" . }}
      key: password
- name: LOOPLINE_DATABASE_URL
  value: {{ printf "postgresql://%s:$(POSTGRES_PASSWORD)@%s:5432/%s" .Values.postgres.username (include "loopline.componentName" (dict "root" . "component" "postgres")) .Values.postgres.database | quote }}
{{- else -}}
- name: LOOPLINE_DATABASE_URL
  valueFrom:
    secretKeyRef:
      {{- if .Values.postgres.externalUrlSecret.name }}
      name: {{ .Values.postgres.externalUrlSecret.name }}
      key: {{ .Values.postgres.externalUrlSecret.key }}
      {{- else }}
      name: {{ include "loopline.componentName" (dict "root" . "component" "database") }}
      key: url
      {{- end }}
{{- end -}}
{{- end -}}

{{/* The claim that holds the job directories. */}}
{{- define "loopline.jobsClaimName" -}}
{{- .Values.jobs.existingClaim | default (include "loopline.componentName" (dict "root" . "component" "jobs")) -}}
{{- end -}}

{{/* Whether anything uses the job directories (and so the chart makes their claim). */}}
{{- define "loopline.training" -}}
{{- if or .Values.trainer.enabled .Values.checkpointWatcher.enabled .Values.slurm.enabled -}}true{{- end -}}
{{- end -}}

{{/* The `models` volume: the shared model cache claim, or an emptyDir of the pod's own. */}}
{{- define "loopline.modelsVolume" -}}
- name: models
  {{- if .Values.modelCache.enabled }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim | default (include "loopline.componentName" (dict "root" . "component" "models")) }}
  {{- else }}
  {{- $emptyDir := dict }}
  {{- with .Values.modelCache.emptyDirSizeLimit }}{{ $_ := set $emptyDir "sizeLimit" . }}{{ end }}
  emptyDir: {{ toJson $emptyDir }}
  {{- end }}
{{- end -}}

{{/* The Secret that holds the munge key (key "munge.key") shared by every Slurm container. */}}
{{- define "loopline.mungeSecretName" -}}
{{- .Values.slurm.munge.existingSecret | default (include "loopline.componentName" (dict "root" . "component" "munge")) -}}
{{- end -}}

{{/* slurm.conf and the munge key, mounted where deploy/slurm/loopline-slurm looks for them. */}}
{{- define "loopline.slurmVolumes" -}}
- name: slurm-conf
  configMap:
    name: {{ include "loopline.componentName" (dict "root" . "component" "slurm") }}
- name: munge-key
  secret:
    secretName: {{ include "loopline.mungeSecretName" . }}
    defaultMode: 0440
    items:
      - key: munge.key
        path: munge.key
{{- end -}}

{{- define "loopline.slurmVolumeMounts" -}}
- name: slurm-conf
  mountPath: /etc/slurm
  readOnly: true
- name: munge-key
  mountPath: /etc/munge-key
  readOnly: true
{{- end -}}

{{/*
A service's own `env` map and `extraEnv` list, as one YAML list (empty string when both are empty).
Usage: include "loopline.extraEnv" .Values.gateway
*/}}
{{- define "loopline.extraEnv" -}}
{{- $env := list -}}
{{- range $name, $value := .env -}}
{{- $env = append $env (dict "name" $name "value" (toString $value)) -}}
{{- end -}}
{{- $env = concat $env (.extraEnv | default list) -}}
{{- if $env -}}
{{- toYaml $env -}}
{{- end -}}
{{- end -}}

{{/*
Pod scheduling fields from a service's values (empty string when none are set).
Usage: include "loopline.scheduling" .Values.queue
*/}}
{{- define "loopline.scheduling" -}}
{{- $out := dict -}}
{{- with .nodeSelector }}{{ $_ := set $out "nodeSelector" . }}{{ end -}}
{{- with .tolerations }}{{ $_ := set $out "tolerations" . }}{{ end -}}
{{- with .affinity }}{{ $_ := set $out "affinity" . }}{{ end -}}
{{- if $out -}}
{{- toYaml $out -}}
{{- end -}}
{{- end -}}

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
{{- if .Values.postgres.password -}}
{{- .Values.postgres.password -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "loopline.postgresSecretName" .) -}}
{{- if and $existing $existing.data (hasKey $existing.data "password") -}}
{{- index $existing.data "password" | b64dec -}}
{{- else -}}
{{- randAlphaNum 32 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Environment shared by every Loopline container. Usage: include "loopline.commonEnv" $ */}}
{{- define "loopline.commonEnv" -}}
- name: LOOPLINE_NATS_URL
  value: {{ include "loopline.natsUrl" . | quote }}
- name: LOOPLINE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: LOOPLINE_STATE_DIR
  value: /var/lib/loopline
# Each pod names its replica after itself, so logs and /v1/health agree with kubectl.
- name: LOOPLINE_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- with .Values.otlpEndpoint }}
- name: LOOPLINE_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
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

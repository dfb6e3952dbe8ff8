{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "sluicegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects: release name, plus chart name unless the release name already contains it. */}}
{{- define "sluicegate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart label: name-version. */}}
{{- define "sluicegate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "sluicegate.labels" -}}
helm.sh/chart: {{ include "sluicegate.chart" . }}
{{ include "sluicegate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels the Deployment and Service select on (never change them: selectors are immutable). */}}
{{- define "sluicegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluicegate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The ServiceAccount the pods run as. */}}
{{- define "sluicegate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluicegate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference; the tag defaults to the chart's appVersion. */}}
{{- define "sluicegate.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* Where the ConfigMap's config.toml is mounted. */}}
{{- define "sluicegate.configDir" -}}
/etc/sluicegate
{{- end }}

{{/*
Several dispatchers on one pool need the shared window (docs/scale-out.md):
without it each replica opens its own window and R replicas release up to
R x N. Fails the render when `what` asks for several replicas and neither
the config (`shared_window = "redis"` under [dispatch]) nor
env.SLUICEGATE_DISPATCH_SHARED_WINDOW turns the shared window on.
*/}}
{{- define "sluicegate.requireSharedWindow" -}}
{{- $inConfig := regexMatch "(?m)^\\s*shared_window\\s*=\\s*\"redis\"" .ctx.Values.config }}
{{- $inEnv := eq (toString (index .ctx.Values.env "SLUICEGATE_DISPATCH_SHARED_WINDOW" | default "")) "redis" }}
{{- if not (or $inConfig $inEnv) }}
{{- fail (printf "%s needs the shared window across replicas: set shared_window = \"redis\" under [dispatch] in config (docs/scale-out.md), or keep one replica" .what) }}
{{- end }}
{{- end }}

{{/*
The drain grace from the config (`shutdown_grace = "<n>s"`, default 30 s);
terminationGracePeriodSeconds must exceed it by a margin for the final
result writes, or Kubernetes SIGKILLs a draining dispatcher.
*/}}
{{- define "sluicegate.checkGrace" -}}
{{- $grace := 30 }}
{{- $found := regexFind "(?m)^\\s*shutdown_grace\\s*=\\s*\"[0-9]+s\"" .Values.config }}
{{- if $found }}
{{- $grace = regexFind "[0-9]+" $found | int }}
{{- end }}
{{- with .Values.env.SLUICEGATE_DISPATCH_SHUTDOWN_GRACE }}
{{- if regexMatch "^[0-9]+s$" (toString .) }}
{{- $grace = trimSuffix "s" (toString .) | int }}
{{- end }}
{{- end }}
{{- if lt (int .Values.terminationGracePeriodSeconds) (add $grace 10 | int) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be at least dispatch.shutdown_grace (%ds) + 10s, so a draining dispatcher is not killed" (int .Values.terminationGracePeriodSeconds) $grace) }}
{{- end }}
{{- end }}

{{/*
KEDA's Prometheus, required by either ScaledObject.
*/}}
{{- define "sluicegate.kedaPrometheus" -}}
{{- required "keda.prometheus.serverAddress is required when keda.enabled or keda.pool.enabled" .Values.keda.prometheus.serverAddress }}
{{- end }}

{{/*
The backlog and the work due within keda.due.withinSeconds, each the max
per queue over the replicas, summed over queues.
*/}}
{{- define "sluicegate.backlogQuery" -}}
{{- printf "sum(max by (queue) (sluicegate_queue_backlog_messages{namespace=%q, service=%q}))" .Release.Namespace (include "sluicegate.fullname" .) }}
{{- end }}
{{- define "sluicegate.dueQuery" -}}
{{- printf "sum(max by (queue) (sluicegate_queue_due_messages{namespace=%q, service=%q, within_seconds=\"%v\"}))" .Release.Namespace (include "sluicegate.fullname" .) .Values.keda.due.withinSeconds }}
{{- end }}

{{/*
keda.due.withinSeconds must name a horizon the dispatcher exports
(src/queue/due.rs): another value would match no series and never scale.
*/}}
{{- define "sluicegate.requireDueHorizon" -}}
{{- $horizons := list "60" "300" "900" "3600" "14400" "86400" }}
{{- if not (has (toString .Values.keda.due.withinSeconds) $horizons) }}
{{- fail (printf "keda.due.withinSeconds: %v is not a horizon the dispatcher exports; allowed: %s" .Values.keda.due.withinSeconds (join ", " $horizons)) }}
{{- end }}
{{- end }}

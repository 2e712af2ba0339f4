{{/* Names and labels shared by every template. */}}
{{- define "deepfleet.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "deepfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "deepfleet.labels" -}}
app.kubernetes.io/name: {{ include "deepfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "deepfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "deepfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "deepfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "deepfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "deepfleet.jobNamespace" -}}
{{- default .Release.Namespace .Values.jobNamespace -}}
{{- end -}}

{{- define "deepfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "deepfleet.dbSecretName" -}}
{{- default (printf "%s-db" (include "deepfleet.fullname" .)) .Values.database.existingSecret -}}
{{- end -}}

{{/* True (non-empty) when no external database is configured: SQLite on the chart's volume. */}}
{{- define "deepfleet.embedded" -}}
{{- if and (not .Values.database.existingSecret) (not .Values.database.url) -}}true{{- end -}}
{{- end -}}

{{- define "deepfleet.dataDir" -}}/var/lib/deepfleet{{- end -}}

{{- define "deepfleet.adminSecretName" -}}
{{- default (printf "%s-admin" (include "deepfleet.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}

{{- define "deepfleet.dbEnv" -}}
{{- if include "deepfleet.embedded" . }}
- name: DEEPFLEET_DATABASE_URL
  value: {{ printf "sqlite:///%s/deepfleet.db" (include "deepfleet.dataDir" .) | quote }}
{{- else }}
- name: DEEPFLEET_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "deepfleet.dbSecretName" . }}
      key: {{ .Values.database.existingSecretKey }}
{{- end }}
- name: DEEPFLEET_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "deepfleet.dbSecretName" . }}
      key: {{ .Values.database.jobTokenKeySecretKey }}
{{- with .Values.config.oldSecrets }}{{ if .secretName }}
- name: DEEPFLEET_OLD_SECRETS
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- end -}}

{{- define "deepfleet.adminEnv" -}}
- name: DEEPFLEET_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "deepfleet.adminSecretName" . }}
      key: {{ .Values.adminToken.existingSecretKey }}
- name: DEEPFLEET_ADMIN_PROJECT
  value: {{ .Values.adminToken.project | quote }}
{{- end -}}

{{- define "deepfleet.validate" -}}
{{- if and (include "deepfleet.embedded" .) (gt (int .Values.replicaCount) 1) -}}
{{- fail "replicaCount: the embedded SQLite database serves one replica; set replicaCount: 1, or database.url / database.existingSecret (PostgreSQL) to run more" -}}
{{- end -}}
{{- end -}}

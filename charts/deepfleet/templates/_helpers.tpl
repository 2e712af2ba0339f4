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

{{- define "deepfleet.dbEnv" -}}
- name: DEEPFLEET_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "deepfleet.dbSecretName" . }}
      key: {{ .Values.database.existingSecretKey }}
- name: DEEPFLEET_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "deepfleet.dbSecretName" . }}
      key: {{ .Values.database.jobTokenKeySecretKey }}
{{- end -}}

{{- define "deepfleet.validate" -}}
{{- if and (not .Values.database.existingSecret) (not .Values.database.url) -}}
{{- fail "database: set database.existingSecret (a Secret holding the DB URL) or database.url" -}}
{{- end -}}
{{- end -}}

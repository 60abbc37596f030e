{{/* The release's base name, at most 40 characters so pod names stay valid DNS labels. */}}
{{- define "hora.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "hora.workers" -}}{{ include "hora.fullname" . }}-worker{{- end -}}

{{- define "hora.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Checks made before anything renders: they fail the install with a message. */}}
{{- define "hora.validate" -}}
{{- if not .Values.command -}}
{{- fail "values: command is required: the training command the launcher runs with hora run, e.g. --set command={python,/opt/hora-examples/pytorch_mnist.py}" -}}
{{- end -}}
{{- if lt (int .Values.workers) 1 -}}
{{- fail (printf "values: workers must be at least 1 (got %v)" .Values.workers) -}}
{{- end -}}
{{- if lt (int .Values.slotsPerWorker) 1 -}}
{{- fail (printf "values: slotsPerWorker must be at least 1 (got %v)" .Values.slotsPerWorker) -}}
{{- end -}}
{{- if .Values.elastic.enabled -}}
{{- if lt (int .Values.elastic.minWorkers) 1 -}}
{{- fail (printf "values: elastic.minWorkers must be at least 1 (got %v)" .Values.elastic.minWorkers) -}}
{{- end -}}
{{- if gt (int .Values.elastic.minWorkers) (int .Values.elastic.maxWorkers) -}}
{{- fail (printf "values: elastic.minWorkers (%v) is greater than elastic.maxWorkers (%v)" .Values.elastic.minWorkers .Values.elastic.maxWorkers) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Pod settings shared by workers and launcher. */}}
{{- define "hora.podCommon" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- if .Values.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "hora.sshVolume" -}}
- name: ssh-key
  secret:
    secretName: {{ include "hora.fullname" . }}-ssh
    defaultMode: 0600
{{- end -}}

{{- define "hora.env" -}}
- name: HORA_SSH_PORT
  value: {{ .Values.sshPort | quote }}
- name: HORA_SSH_SECRET_DIR
  value: /etc/hora/ssh
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

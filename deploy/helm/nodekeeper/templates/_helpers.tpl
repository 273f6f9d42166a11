{{/* The image reference of one component: repository@digest when a digest is set, else repository:tag. */}}
{{- define "nodekeeper.image" -}}
{{- if .digest -}}
{{ .repository }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ .tag }}
{{- end -}}
{{- end -}}

{{/* Labels of one component (its name), plus commonLabels. */}}
{{- define "nodekeeper.labels" -}}
app.kubernetes.io/name: {{ .name }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* commonLabels alone, for objects the kustomize base leaves unlabelled. */}}
{{- define "nodekeeper.commonLabels" -}}
{{- with .Values.commonLabels }}
labels:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

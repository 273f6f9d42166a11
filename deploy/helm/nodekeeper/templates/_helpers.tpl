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

{{/* The Nodes the controller manages, as a label selector in kubectl's syntax (its
--node-selector): controller.managedNodeSelector, or else agent.nodeSelector as `key=value,...`
(keys sorted), since a Node without an agent could only ever read NodekeeperReachable=False.
Empty: every Node. */}}
{{- define "nodekeeper.managedNodeSelector" -}}
{{- if .Values.controller.managedNodeSelector -}}
{{ .Values.controller.managedNodeSelector }}
{{- else -}}
{{- $terms := list -}}
{{- range $key, $value := .Values.agent.nodeSelector -}}
{{- $terms = append $terms (printf "%s=%s" $key $value) -}}
{{- end -}}
{{ join "," $terms }}
{{- end -}}
{{- end -}}

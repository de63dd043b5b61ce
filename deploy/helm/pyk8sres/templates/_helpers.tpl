{{/* Names and labels shared by every object. */}}
{{- define "pyk8sres.labels" -}}
app.kubernetes.io/name: pyk8sres-coordinator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "pyk8sres.selector" -}}
app.kubernetes.io/name: pyk8sres-coordinator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Who runs a daemon: its own ServiceAccount, or in mode sidecar the
     slurmctld pod's (one pod, one identity: both daemons' roles). */}}
{{- define "pyk8sres.subject" -}}
{{- $ := index . 0 }}
{{- $name := ternary "pyk8sres-slurmctld" (printf "pyk8sres-%s" (index . 1)) (eq $.Values.coordinator.mode "sidecar") -}}
{kind: ServiceAccount, name: {{ $name }}, namespace: {{ $.Release.Namespace }}}
{{- end }}

{{- define "pyk8sres.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The values must agree with each other; a contradiction stops the render
     with a message naming the value. */}}
{{- define "pyk8sres.validate" -}}
{{- if not (has .Values.coordinator.mode (list "deployment" "sidecar" "none")) }}
{{- fail (printf "coordinator.mode: %q is not one of deployment, sidecar, none" .Values.coordinator.mode) }}
{{- end }}
{{- if not .Values.webhook.apiServerClientCA }}
{{- fail "webhook.apiServerClientCA is required: the PEM of the CA of the client certificate kube-apiserver presents to admission webhooks (--set-file webhook.apiServerClientCA=ca.crt; docs/security.md)" }}
{{- end }}
{{- if not (contains "BEGIN CERTIFICATE" .Values.webhook.apiServerClientCA) }}
{{- fail "webhook.apiServerClientCA: not a PEM certificate" }}
{{- end }}
{{- if and .Values.webhook.certManager.enabled (not (.Capabilities.APIVersions.Has "cert-manager.io/v1")) }}
{{- fail "webhook.certManager.enabled is true but this cluster does not serve cert-manager.io/v1: install cert-manager first, or leave it false for the chart's own CA" }}
{{- end }}
{{- if and (gt (int .Values.webhook.replicas) 1) (eq .Values.coordinator.mode "sidecar") }}
{{- fail "webhook.replicas > 1 with coordinator.mode sidecar: the sidecar runs once, beside slurmctld" }}
{{- end }}
{{- range $k8s, $slurm := .Values.sync.nodeMap }}
{{- if or (not $k8s) (not $slurm) }}
{{- fail (printf "sync.nodeMap: %q -> %q names no node (both sides must be node names)" $k8s $slurm) }}
{{- end }}
{{- end }}
{{- if ge (mulf 2 (float64 .Values.ledger.timeoutSeconds)) (float64 .Values.webhook.timeoutSeconds) }}
{{- fail (printf "ledger.timeoutSeconds (%v) must be under half of webhook.timeoutSeconds (%v): a review may wait the ledger's timeout for its turn and again for its reply, and must be refused with that reason before the API server gives up" .Values.ledger.timeoutSeconds .Values.webhook.timeoutSeconds) }}
{{- end }}
{{- if and .Values.sync.workerPods (not .Values.sync.workerNamespace) }}
{{- fail (printf "sync.workerPods %q needs sync.workerNamespace: worker pods are only taken from the namespace Slurm runs in" .Values.sync.workerPods) }}
{{- end }}
{{- if and (not .Values.sync.workerPods) (or .Values.sync.workerNamespace .Values.sync.workerLabels .Values.sync.workerNodeName) }}
{{- fail "sync.workerNamespace, workerLabels and workerNodeName need sync.workerPods (slinky, ack or custom)" }}
{{- end }}
{{- if not (hasPrefix "node-restriction.kubernetes.io/" .Values.sync.nodeKey) }}
{{- fail (printf "sync.nodeKey: %q must be under node-restriction.kubernetes.io/ (a label kubelets cannot set)" .Values.sync.nodeKey) }}
{{- end }}
{{- if and .Values.metrics.prometheusRule (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) }}
{{- fail "metrics.prometheusRule is true but this cluster does not serve monitoring.coreos.com/v1 (the Prometheus operator)" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) }}
{{- fail "metrics.serviceMonitor is true but this cluster does not serve monitoring.coreos.com/v1 (the Prometheus operator)" }}
{{- end }}
{{- if and (include "pyk8sres.networkPolicy" .) (not .Values.networkPolicy.apiServerCIDRs) }}
{{- fail "networkPolicy.apiServerCIDRs is required while networkPolicy.enabled (the default): the addresses kube-apiserver calls the webhook from (else nothing could reach it; docs/security.md), or networkPolicy.enabled=false" }}
{{- end }}
{{- end }}

{{/* Whether the NetworkPolicy renders: mode deployment only (in mode
     sidecar the pod is slurmctld's, whose own traffic it would cut; in
     mode none no pod of ours runs in the cluster). */}}
{{- define "pyk8sres.networkPolicy" -}}
{{- if and .Values.networkPolicy.enabled (eq .Values.coordinator.mode "deployment") }}true{{ end }}
{{- end }}

{{/* The coordinator's settings file (TOML: pyk8sres.coordinator.config.SyncConfig
     and the [webhook] table). */}}
{{- define "pyk8sres.config" -}}
[sync]
ledger_socket = {{ printf "/run/pyk8sres-ledger/%s" .Values.ledger.socket | quote }}
node_key = {{ .Values.sync.nodeKey | quote }}
map_by_name = {{ .Values.sync.mapByName }}
slurm_workers = [{{ range $i, $w := .Values.sync.slurmWorkers }}{{ if $i }}, {{ end }}{{ $w | quote }}{{ end }}]
placeholder_namespace = {{ .Values.placeholders.namespace | quote }}
reservation_grace = {{ .Values.sync.reservationGraceSeconds | float64 }}
departed_margin_seconds = {{ .Values.sync.departedMarginSeconds | float64 }}
generic_node_qps = {{ .Values.sync.genericNodeQPS | float64 }}
generic_node_burst = {{ .Values.sync.genericNodeBurst | int }}
generic_node_min_interval_seconds = {{ .Values.sync.genericNodeMinIntervalSeconds | float64 }}
legacy_gpu = {{ .Values.sync.legacyGpu | quote }}
create_crd = false
{{- with .Values.slurm.clusterName }}
cluster_name = {{ . | quote }}
{{- end }}
{{- with .Values.sync.workerPods }}
worker_pods = {{ . | quote }}
worker_namespace = {{ $.Values.sync.workerNamespace | quote }}
worker_node_name = {{ $.Values.sync.workerNodeName | quote }}
{{- end }}
[sync.node_map]
{{- range $k8s, $slurm := .Values.sync.nodeMap }}
{{ $k8s | quote }} = {{ $slurm | quote }}
{{- end }}
{{- if .Values.sync.workerPods }}
[sync.worker_labels]
{{- range $k, $v := .Values.sync.workerLabels }}
{{ $k | quote }} = {{ $v | quote }}
{{- end }}
{{- end }}

[webhook]
listen = "0.0.0.0:8443"
metrics_address = "0.0.0.0:9711"
tls_cert_file = "/etc/pyk8sres/tls/tls.crt"
tls_key_file = "/etc/pyk8sres/tls/tls.key"
client_ca_file = "/etc/pyk8sres/apiserver-client-ca/ca.crt"
client_names = [{{ range $i, $n := .Values.webhook.apiServerClientNames }}{{ if $i }}, {{ end }}{{ $n | quote }}{{ end }}]
ledger_timeout = {{ .Values.ledger.timeoutSeconds | float64 }}
configuration = {{ include "pyk8sres.webhookName" . | quote }}
{{- end }}

{{- define "pyk8sres.webhookName" -}}pyk8sres-admission{{- end }}

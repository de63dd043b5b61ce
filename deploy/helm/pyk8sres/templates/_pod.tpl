{{/* The coordinator's two containers and their volumes, for a Deployment
     each (mode deployment) or the slurmctld pod (mode sidecar). */}}
{{- define "pyk8sres.securityContext" -}}
runAsUser: {{ .Values.coordinator.uid }}
runAsGroup: {{ .Values.coordinator.gid }}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{- define "pyk8sres.container.sync" -}}
- name: sync
  image: {{ include "pyk8sres.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: [sync, --config, /etc/pyk8sres/config/coordinator.toml, --metrics-address, "0.0.0.0:9710"]
  env: [{name: SLURM_CONF, value: /etc/slurm/slurm.conf}]
  ports: [{name: metrics, containerPort: 9710}]     # /metrics, /healthz, /readyz
  livenessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 10
    failureThreshold: 6
  securityContext: {{- include "pyk8sres.securityContext" . | nindent 4 }}
  resources: {{- toYaml .Values.coordinator.resources | nindent 4 }}
  volumeMounts:
  - {name: config, mountPath: /etc/pyk8sres/config, readOnly: true}
  - {name: ledger, mountPath: /run/pyk8sres-ledger, readOnly: true}
  - {name: slurm-etc, mountPath: /etc/slurm, readOnly: true}
  - {name: munge, mountPath: /run/munge, readOnly: true}
  - {name: tmp, mountPath: /tmp}
{{- end }}

{{- define "pyk8sres.container.webhook" -}}
- name: webhook
  image: {{ include "pyk8sres.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: [webhook, --config, /etc/pyk8sres/config/coordinator.toml]
  ports: [{name: webhook, containerPort: 8443}, {name: metrics, containerPort: 9711}]
  # /readyz needs the ledger too: as a readiness probe it would empty the
  # Service while slurmctld is down (pods on shared nodes are refused either way).
  livenessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 10
    failureThreshold: 6
  securityContext: {{- include "pyk8sres.securityContext" . | nindent 4 }}
  resources: {{- toYaml .Values.coordinator.resources | nindent 4 }}
  volumeMounts:
  - {name: config, mountPath: /etc/pyk8sres/config, readOnly: true}
  - {name: ledger, mountPath: /run/pyk8sres-ledger, readOnly: true}
  - {name: tls, mountPath: /etc/pyk8sres/tls, readOnly: true}
  - {name: apiserver-client-ca, mountPath: /etc/pyk8sres/apiserver-client-ca, readOnly: true}
  - {name: tmp, mountPath: /tmp}
{{- end }}

{{- define "pyk8sres.volumes" -}}
- {name: config, configMap: {name: pyk8sres-coordinator}}
- {name: tls, secret: {secretName: pyk8sres-webhook-tls, defaultMode: 0440}}
- {name: apiserver-client-ca, configMap: {name: pyk8sres-apiserver-client-ca}}
- {name: tmp, emptyDir: {}}
{{- end }}

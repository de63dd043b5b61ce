{{/* The webhook's CA and serving certificate: the existing Secret's when
     there is one (upgrades keep them), else new ones (10 years, as the
     coordinator's own CA; rotate by deleting the Secret and upgrading).
     `helm template` cannot look up: it makes new ones each time. */}}
{{- define "pyk8sres.tls" -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace "pyk8sres-webhook-tls" }}
{{- if and $old $old.data (index $old.data "ca.crt") }}
ca: {{ index $old.data "ca.crt" | b64dec | quote }}
cert: {{ index $old.data "tls.crt" | b64dec | quote }}
key: {{ index $old.data "tls.key" | b64dec | quote }}
{{- else }}
{{- $ca := genCA "pyk8sres webhook CA" 3650 }}
{{- $svc := printf "pyk8sres-coordinator.%s.svc" .Release.Namespace }}
{{- $names := list $svc (printf "%s.cluster.local" $svc) }}
{{- $ips := list }}
{{- with .Values.webhook.url }}
{{- $host := (split ":" (urlParse .).host)._0 }}
{{- if regexMatch "^[0-9.]+$" $host }}{{ $ips = append $ips $host }}{{ else }}{{ $names = append $names $host }}{{ end }}
{{- end }}
{{- $cert := genSignedCert $svc $ips $names 3650 $ca }}
ca: {{ $ca.Cert | quote }}
cert: {{ $cert.Cert | quote }}
key: {{ $cert.Key | quote }}
{{- end }}
{{- end }}

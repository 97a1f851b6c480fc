{{/*
Helpers for the arc-serving chart. Every helper is namespaced "arc-serving." so that a parent
chart that vendors this one cannot collide with them.
*/}}

{{/*
Chart name, from nameOverride. Kubernetes names are DNS-1123 labels of at most 63 characters.
*/}}
{{- define "arc-serving.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: the release name, suffixed with the chart name unless the release
name already contains it. Truncated to 40 characters because components append "-" and a
component name of at most 22 characters, and the result must stay a 63-character DNS-1123
label without cutting into the suffix (two cut suffixes could collide): 40 + 1 + 22 = 63.
*/}}
{{- define "arc-serving.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A component's resource name: fullname + "-" + component (components are at most 22
characters, see fullname). Call with (dict "context" $ "component" "operator").
*/}}
{{- define "arc-serving.componentName" -}}
{{- printf "%s-%s" (include "arc-serving.fullname" .context) .component }}
{{- end }}

{{/*
Chart label value: name-version, "+" replaced because label values may not contain it.
*/}}
{{- define "arc-serving.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: stable for the life of a release (Deployment selectors are immutable).
*/}}
{{- define "arc-serving.selectorLabels" -}}
app.kubernetes.io/name: {{ include "arc-serving.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Common labels on every object the chart renders.
*/}}
{{- define "arc-serving.labels" -}}
helm.sh/chart: {{ include "arc-serving.chart" . }}
{{ include "arc-serving.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: arc-serving
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels for one component. Call with (dict "context" $ "component" "operator").
*/}}
{{- define "arc-serving.componentLabels" -}}
{{ include "arc-serving.labels" .context }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Selector labels for one component. Call with (dict "context" $ "component" "operator").
*/}}
{{- define "arc-serving.componentSelectorLabels" -}}
{{ include "arc-serving.selectorLabels" .context }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Image reference: registry/repository:tag, or @digest when a digest pins it. The tag defaults
to the chart's appVersion. Call with (dict "image" .Values.operator.image "context" $).
*/}}
{{- define "arc-serving.image" -}}
{{- $repo := .image.repository }}
{{- if .image.registry }}
{{- $repo = printf "%s/%s" .image.registry .image.repository }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repo .image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .context.Chart.AppVersion .image.tag | toString) }}
{{- end }}
{{- end }}

{{/*
The operator's ServiceAccount name.
*/}}
{{- define "arc-serving.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "arc-serving.componentName" (dict "context" . "component" "operator")) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The Lease the operator's replicas elect their one acting leader on (arc_operator.leadership):
one per release, in the release namespace, named as the operator's Deployment.
*/}}
{{- define "arc-serving.operator.leaseName" -}}
{{- include "arc-serving.componentName" (dict "context" . "component" "operator") }}
{{- end }}

{{/*
Name of the default ServingPolicy, which is also the name of the Deployment and Service the
operator creates for it (conventions: Deployment NAME, Service NAME, ConfigMap NAME-policy).
The hard limit on the name is 63 characters: it is the Service's name (a DNS-1035 label) and
the value of the engine pods' labels (app.kubernetes.io/instance, arcserving.io/servingpolicy),
both at most 63. The schema caps servingPolicy.name at 56, 7 below that, which also keeps the
operator's "NAME-policy" ConfigMap name a 63-character label (ConfigMap names alone may be 253).
*/}}
{{- define "arc-serving.servingPolicyName" -}}
{{- default (include "arc-serving.fullname" .) .Values.servingPolicy.name }}
{{- end }}

{{/*
The default ServingPolicy's effective routing policy (docs/architecture.md, "Routing"):
servingPolicy.routing.policy when set, else the operator's default, kv_aware when the
ServingPolicy has more than one replica and none otherwise. The ServingPolicy template passes
the result explicitly whenever the operator's default could differ from it, so what the
Ingress, the load test and helm test target always matches what the operator runs.
*/}}
{{- define "arc-serving.routingPolicy" -}}
{{- $routing := .Values.servingPolicy.routing }}
{{- if $routing.policy }}
{{- $routing.policy }}
{{- else if gt (int .Values.servingPolicy.replicas) 1 }}
{{- "kv_aware" }}
{{- else }}
{{- "none" }}
{{- end }}
{{- end }}

{{/*
The Service the ingress and the load test send requests to: ingress.serviceName, else the
default ServingPolicy's Service: the router's, NAME-router, when its routing policy is not
none, else the engines', NAME (the operator's names; NAME is at most 56 characters, so
NAME-router fits a 63-character Service name). Fails when neither exists, since nothing would
create it.
*/}}
{{- define "arc-serving.servingServiceName" -}}
{{- if .Values.ingress.serviceName }}
{{- .Values.ingress.serviceName }}
{{- else if .Values.servingPolicy.enabled }}
{{- include "arc-serving.defaultServiceName" . }}
{{- else }}
{{- fail "arc-serving: servingPolicy.enabled is false, so the chart creates no ServingPolicy and no Service for the ingress or the load test to send requests to; set ingress.serviceName to an existing ServingPolicy's Service (and loadtest.host for a load test without the ingress), or enable servingPolicy" }}
{{- end }}
{{- end }}

{{/*
The default ServingPolicy's Service clients send requests to: NAME-router when its routing
policy is not none, else NAME.
*/}}
{{- define "arc-serving.defaultServiceName" -}}
{{- include "arc-serving.servingPolicyName" . }}
{{- if ne (include "arc-serving.routingPolicy" .) "none" }}-router{{ end }}
{{- end }}

{{/*
The Service the HTTPRoute sends requests to: httpRoute.serviceName, else the default
ServingPolicy's, as for the Ingress. Fails when neither exists.
*/}}
{{- define "arc-serving.httpRouteServiceName" -}}
{{- if .Values.httpRoute.serviceName }}
{{- .Values.httpRoute.serviceName }}
{{- else if .Values.servingPolicy.enabled }}
{{- include "arc-serving.defaultServiceName" . }}
{{- else }}
{{- fail "arc-serving: servingPolicy.enabled is false, so the chart creates no ServingPolicy and no Service for the HTTPRoute to send requests to; set httpRoute.serviceName to an existing ServingPolicy's Service, or enable servingPolicy" }}
{{- end }}
{{- end }}

{{/*
Annotations of the pre-delete cleanup hook's objects. Call with the hook weight as a string.
*/}}
{{- define "arc-serving.cleanupHookAnnotations" -}}
helm.sh/hook: pre-delete
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end }}

{{/*
The served model name clients put in requests: servedName, else the model name itself.
*/}}
{{- define "arc-serving.servedModelName" -}}
{{- default .Values.servingPolicy.model.name .Values.servingPolicy.model.servedName }}
{{- end }}

{{/*
Base URL the load test replays against: loadtest.host when set, else always the serving
Service inside the cluster, ingress or not: the ingress routes only /v1, and the load test also
reads /tokenize (the vocabulary, unless it has a tokenizer) and /metrics (the cache counters).
*/}}
{{- define "arc-serving.loadtestHost" -}}
{{- if .Values.loadtest.host }}
{{- .Values.loadtest.host }}
{{- else }}
{{- printf "http://%s.%s.svc:8000" (include "arc-serving.servingServiceName" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
Name of the ConfigMap holding the load-test trace: an existing one, or the chart's own.
*/}}
{{- define "arc-serving.loadtestTraceConfigMap" -}}
{{- default (include "arc-serving.componentName" (dict "context" . "component" "loadtest-trace")) .Values.loadtest.trace.existingConfigMap }}
{{- end }}

{{/*
Namespace the dashboard ConfigMaps go to (the Grafana sidecar may watch only its own).
*/}}
{{- define "arc-serving.dashboardsNamespace" -}}
{{- default .Release.Namespace .Values.dashboards.namespace }}
{{- end }}

{{/*
Relabelings shared by the engine and router PodMonitors and ServiceMonitors (the operator
labels router pods with arcserving.io/servingpolicy too): every series gets the
`servingpolicy` label (from the pod label arcserving.io/servingpolicy) that the dashboards and
alerts group by; `namespace` and `pod` come from the Prometheus Operator itself (endpoint discovery for a
ServiceMonitor also carries the backing pod's labels).
*/}}
{{- define "arc-serving.engineRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_arcserving_io_servingpolicy]
  targetLabel: servingpolicy
{{- end }}

{{/*
The label selector of the monitors (podmonitor.yaml, servicemonitor.yaml) for one role,
"engine" or "router": the labels the operator puts on the pods and Services of any
ServingPolicy, the engines' (name arc-serving-engine) or the routers' (name arc-serving-router,
docs/architecture.md, "Routing"). Call with the role.
*/}}
{{- define "arc-serving.monitorSelector" -}}
matchLabels:
  app.kubernetes.io/name: arc-serving-{{ . }}
  app.kubernetes.io/managed-by: arc-serving-operator
{{- end }}

{{/*
The Secret holding the serving API key: servingPolicy.apiKey.existingSecret, else the one the
chart creates (api-key-secret.yaml).
*/}}
{{- define "arc-serving.apiKeySecretName" -}}
{{- default (include "arc-serving.componentName" (dict "context" . "component" "api-key")) .Values.servingPolicy.apiKey.existingSecret }}
{{- end }}

{{/*
checkov skip annotations (checkov.io/skipN: CHECK=reason) for a workload, each a check that is
wrong for it, with the reason; reasons may not contain "=". The image checks are skipped only
while they would fail: CKV_K8S_43 until the image is pinned by digest, CKV_K8S_15 while the
pull policy is not Always. Call with (dict "image" .Values.operator.image "skips" (list ...)).
*/}}
{{- define "arc-serving.checkovSkips" -}}
{{- $skips := .skips | default list }}
{{- if not .image.digest }}
{{- $skips = append $skips "CKV_K8S_43=tagged by default; set the image digest value to pin it and the chart renders repository@digest" }}
{{- end }}
{{- if ne (.image.pullPolicy | default "IfNotPresent") "Always" }}
{{- $skips = append $skips "CKV_K8S_15=pinned tags and digests do not change, so IfNotPresent saves a registry round trip per start; set pullPolicy Always where nodes share cached images between tenants" }}
{{- end }}
{{- /* One line per skip, no leading newline: callers indent it with nindent. */}}
{{- range $index, $skip := $skips }}
{{- if $index }}
{{ end }}checkov.io/skip{{ add1 $index }}: {{ $skip | quote }}
{{- end }}
{{- end }}

{{/*
NetworkPolicy peers the operator builds each ServingPolicy's NetworkPolicies from
(docs/architecture.md, "Routing"), as JSON lists of NetworkPolicyPeer objects. Call with
(dict "context" $ "peers" "serving") or "monitoring".

serving (ARC_OPERATOR_SERVING_PEERS), the API's clients: they reach port 8000 of the serving
pods when the routing policy is none, of the router pods otherwise. The ingress controller,
this release's load-test and helm-test pods (release namespace), with httpRoute.enabled each
parent Gateway's pods by the label GEP-1762 has implementations put on them
(gateway.networking.k8s.io/gateway-name, in the Gateway's namespace), then
networkPolicy.extraServingFrom.

monitoring (ARC_OPERATOR_MONITORING_PEERS), the metrics scrapers: they reach the serving pods'
port 8000 (vLLM's /metrics) whatever the routing, and the router pods' metrics port 29000.
Prometheus and this release's operator (status scrapes, release namespace).
*/}}
{{- define "arc-serving.operatorPeers" -}}
{{- $np := .context.Values.networkPolicy }}
{{- $components := ternary (list "loadtest-master" "loadtest-worker" "test") (list "operator") (eq .peers "serving") }}
{{- $releasePods := dict
  "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .context.Release.Namespace))
  "podSelector" (dict
    "matchLabels" (include "arc-serving.selectorLabels" .context | fromYaml)
    "matchExpressions" (list (dict
      "key" "app.kubernetes.io/component"
      "operator" "In"
      "values" $components))) }}
{{- if eq .peers "serving" }}
{{- $ingress := dict "namespaceSelector" $np.ingressController.namespaceSelector "podSelector" $np.ingressController.podSelector }}
{{- $gateways := list }}
{{- if .context.Values.httpRoute.enabled }}
{{- range .context.Values.httpRoute.parentRefs }}
{{- /* A name too long for a label value is one no pod can carry. */}}
{{- if le (len .name) 63 }}
{{- $gateways = append $gateways (dict
  "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" (default $.context.Release.Namespace .namespace)))
  "podSelector" (dict "matchLabels" (dict "gateway.networking.k8s.io/gateway-name" .name))) }}
{{- end }}
{{- end }}
{{- end }}
{{- concat (list $ingress $releasePods) ($gateways | uniq) ($np.extraServingFrom | default list) | toJson }}
{{- else }}
{{- $prometheus := dict "namespaceSelector" $np.prometheus.namespaceSelector "podSelector" $np.prometheus.podSelector }}
{{- list $prometheus $releasePods | toJson }}
{{- end }}
{{- end }}

{{/*
NetworkPolicy egress rules to DNS and to the API server (networkPolicy.dns, .apiServer), for
the pods that resolve names or call the API. Call with the root context.
*/}}
{{- define "arc-serving.dnsEgress" -}}
- to:
    {{- toYaml .Values.networkPolicy.dns.peers | nindent 4 }}
  ports:
    {{- range .Values.networkPolicy.dns.ports }}
    - port: {{ . }}
      protocol: UDP
    - port: {{ . }}
      protocol: TCP
    {{- end }}
{{- end }}

{{- define "arc-serving.apiServerEgress" -}}
- to:
    {{- range .Values.networkPolicy.apiServer.cidrs }}
    - ipBlock:
        cidr: {{ . }}
    {{- end }}
  ports:
    {{- range .Values.networkPolicy.apiServer.ports }}
    - port: {{ . }}
      protocol: TCP
    {{- end }}
{{- end }}

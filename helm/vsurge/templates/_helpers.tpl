{{/*
Names. Kubernetes names are at most 63 characters; every derived name is cut there too.
*/}}
{{- define "vsurge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vsurge.fullname" -}}
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

{{- define "vsurge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vsurge.operator.fullname" -}}
{{- printf "%s-operator" (include "vsurge.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vsurge.router.fullname" -}}
{{- printf "%s-router" (include "vsurge.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vsurge.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "vsurge.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "vsurge.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "vsurge.router.fullname" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Labels. Call with (dict "ctx" $ "component" "operator"); component may be empty.
*/}}
{{- define "vsurge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vsurge.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "vsurge.labels" -}}
helm.sh/chart: {{ include "vsurge.chart" .ctx }}
{{ include "vsurge.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: vsurge
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
An image reference. Call with (dict "ctx" $ "image" .Values.images.service).
*/}}
{{- define "vsurge.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/*
The hardened security contexts every pod of the chart runs with (Pod Security Standard "restricted").
These are not configurable on purpose; only the ids are (podSecurity).
*/}}
{{- define "vsurge.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "vsurge.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Environment shared by the chart's containers: pod identity from the downward API, a writable HOME on the
/tmp emptyDir (the root filesystem is read-only), and OpenTelemetry when tracing.endpoint is set.
Call with (dict "ctx" $ "service" "vsurge-router").
*/}}
{{- define "vsurge.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- with .ctx.Values.tracing }}
{{- if .endpoint }}
- name: OTEL_SERVICE_NAME
  value: {{ $.service | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplingRatio | toString | quote }}
- name: OTEL_PROPAGATORS
  value: tracecontext,baggage
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),k8s.node.name=$(NODE_NAME)"
{{- end }}
{{- end }}
{{- end }}

{{/*
True ("true") when the operator and the router watch every namespace (ClusterRoles), empty otherwise.
*/}}
{{- define "vsurge.clusterWide" -}}
{{- if not .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
Operator RBAC, one rule per (apiGroup, resource) so that it reads as the table the tests compare it to.
"namespacedRules": what it reconciles in each watched namespace.
*/}}
{{- define "vsurge.operator.namespacedRules" -}}
# The resource it reconciles: read and watch, finalizers and annotations (kopf), status, scale.
- apiGroups: ["vsurge.io"]
  resources: ["inferencemodels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["vsurge.io"]
  resources: ["inferencemodels/status"]
  verbs: ["patch"]
- apiGroups: ["vsurge.io"]
  resources: ["inferencemodels/scale"]
  verbs: ["get", "patch"]
# blockOwnerDeletion on the owner references of what it creates: clusters with the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) require this.
- apiGroups: ["vsurge.io"]
  resources: ["inferencemodels/finalizers"]
  verbs: ["update"]
# What it creates for each model: the workload (single host or multi-host), its Service and PDB.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.compileCache with a size: the claim it creates (and owns) for the compiled programs.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The models' NetworkPolicies (access.py) and a multi-host model's step lane policy (lane.py). Secrets
# are not here: templates/secrets-rbac.yaml grants them per namespace, never cluster-wide.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.gateway: the model's InferencePool (gateway.py).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The autoscaler finds the ready pods of a model to scrape their /metrics.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# kopf and the autoscaler post Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* Secrets, in a namespaced Role only (templates/secrets-rbac.yaml): the operator creates a model's lane
Secret and compile-cache key once and reads back only those it created (model_secrets.py, lane.py: never
list, watch, update or delete; they go with their model); the router reads a model's spec.apiKeySecret by
name (get only). */}}
{{- define "vsurge.operator.secretRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
{{- end }}

{{- define "vsurge.router.secretRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}

{{/* The namespaces where Secrets are granted: the watched ones, or secretNamespaces when watching all
(default: the release namespace). */}}
{{- define "vsurge.secretNamespaces" -}}
{{- if .Values.watchNamespaces }}{{ join "," .Values.watchNamespaces }}{{ else }}{{ join "," (.Values.secretNamespaces | default (list .Release.Namespace)) }}{{ end }}
{{- end }}

{{/* kopf's peering: namespaced KopfPeerings when watching listed namespaces. */}}
{{- define "vsurge.operator.namespacedPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/* What kopf needs cluster-wide in every mode: observe CRDs and namespaces (read-only). */}}
{{- define "vsurge.operator.frameworkClusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{/* kopf's peering when watching all namespaces: ClusterKopfPeerings. */}}
{{- define "vsurge.operator.clusterPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/* The router: find the models and their ready pods (the EndpointSlices of their Services), and wake a
model at zero replicas through its scale subresource. */}}
{{- define "vsurge.router.rules" -}}
- apiGroups: ["vsurge.io"]
  resources: ["inferencemodels"]
  verbs: ["list", "watch"]
- apiGroups: ["vsurge.io"]
  resources: ["inferencemodels/scale"]
  verbs: ["get", "patch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch"]
{{- end }}

{{/* The Secret with the router's API keys file: an existing one, the chart's, or none (empty). */}}
{{- define "vsurge.router.apiKeysSecret" -}}
{{- with .Values.router.apiKeys }}
{{- if .existingSecret }}{{ .existingSecret }}{{ else if .tenants }}{{ printf "%s-api-keys" (include "vsurge.router.fullname" $) | trunc 63 | trimSuffix "-" }}{{ end }}
{{- end }}
{{- end }}

{{/*
Checks of values that the schema cannot express. Rendered from templates/validate.yaml.
*/}}
{{- define "vsurge.validate" -}}
{{- if and .Values.models .Values.watchNamespaces (not (has .Release.Namespace .Values.watchNamespaces)) }}
{{- fail (printf "models are created in the release namespace %q, which is not in watchNamespaces %v: add it, or leave watchNamespaces empty" .Release.Namespace .Values.watchNamespaces) }}
{{- end }}
{{- $names := list }}
{{- range .Values.models }}
{{- if has .name $names }}
{{- fail (printf "models: the name %q is listed twice" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- end }}
{{- if and .Values.router.ingress.enabled (not .Values.router.enabled) }}
{{- fail "router.ingress.enabled needs router.enabled" }}
{{- end }}
{{- if and (eq .Values.router.mode "gateway") .Values.router.ingress.enabled }}
{{- fail "router.mode gateway routes clients through your Gateway instead of the router's Ingress: set router.ingress.enabled to false" }}
{{- end }}
{{- if and (eq .Values.router.mode "gateway") (eq .Values.router.gateway.endpointPicker.type "vsurge") (not .Values.router.enabled) }}
{{- fail "router.gateway.endpointPicker.type vsurge is the router's endpoint picker: set router.enabled, or use type llm-d" }}
{{- end }}
{{- if lt (int .Values.router.terminationGracePeriodSeconds) (add .Values.router.drainSeconds .Values.router.preStopSeconds) }}
{{- fail (printf "router.terminationGracePeriodSeconds (%v) must be at least router.preStopSeconds + router.drainSeconds (%v)" .Values.router.terminationGracePeriodSeconds (add .Values.router.drainSeconds .Values.router.preStopSeconds)) }}
{{- end }}
{{- $pools := list }}
{{- range .Values.models }}{{ $pools = append $pools (printf "%s/%s" $.Release.Namespace .name) }}{{ end }}
{{- range .Values.router.gateway.models }}
{{- $key := printf "%s/%s" (.namespace | default $.Release.Namespace) .name }}
{{- if has $key $pools }}
{{- fail (printf "router.gateway.models: %s is listed twice (chart models get a pool already)" $key) }}
{{- end }}
{{- $pools = append $pools $key }}
{{- end }}
{{- end }}

{{/*
The endpoint picker Service the InferencePools name: router.gateway.endpointPicker.name, else
`<release>-epp` (the router's picker) or `{model}-epp` (llm-d's, one per model; the operator puts the
model's name in place of {model}).
*/}}
{{- define "vsurge.epp.name" -}}
{{- $ep := .Values.router.gateway.endpointPicker }}
{{- if $ep.name }}{{ $ep.name }}{{ else if eq $ep.type "llm-d" }}{model}-epp{{ else }}{{ printf "%s-epp" (include "vsurge.fullname" .) | trunc 63 | trimSuffix "-" }}{{ end }}
{{- end }}

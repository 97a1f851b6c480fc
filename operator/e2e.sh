#!/usr/bin/env bash
# End-to-end check on a real cluster (the one in KUBECONFIG): apply the CRD and the example
# ServingPolicy (with its API key Secret, a random key created here unless the Secret exists),
# and wait until the operator (installed separately, e.g. by the Helm chart) has reconciled it:
# status.observedGeneration set, Deployment/Service/NetworkPolicy/ConfigMap present, and, since the
# example has two replicas (kv_aware routing by default), the router's Deployment, Service,
# ServiceAccount and NetworkPolicy qwen-arc-router.
# Prints "skipped: no cluster configured" and exits 0 when no cluster is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
KUBECTL="${KUBECTL:-kubectl}"
NAMESPACE="${E2E_NAMESPACE:-default}"
TIMEOUT_S="${E2E_TIMEOUT_S:-300}"

if [[ -z "${KUBECONFIG:-}" ]] || ! command -v "$KUBECTL" >/dev/null \
    || ! "$KUBECTL" version --request-timeout=5s >/dev/null 2>&1; then
  echo "skipped: no cluster configured"
  exit 0
fi

"$KUBECTL" apply -f charts/arc-serving/crds/servingpolicies.arcserving.io.yaml
"$KUBECTL" wait --for=condition=Established --timeout=60s crd/servingpolicies.arcserving.io
# The example's key Secret. The key goes through a private file, never the command line
# (visible to `ps`) or the output; an existing Secret (a rerun) keeps its key.
if ! "$KUBECTL" -n "$NAMESPACE" get secret qwen-arc-api-key >/dev/null 2>&1; then
  key_dir="$(mktemp -d)"
  trap 'rm -rf "$key_dir"' EXIT
  (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32), end="")' \
    > "$key_dir/api-key")
  "$KUBECTL" -n "$NAMESPACE" create secret generic qwen-arc-api-key \
    --from-file=api-key="$key_dir/api-key" >/dev/null
  rm -rf "$key_dir"
  echo "e2e: created Secret qwen-arc-api-key (random key)"
fi
"$KUBECTL" -n "$NAMESPACE" apply -f operator/examples/servingpolicy-arc.yaml
"$KUBECTL" -n "$NAMESPACE" wait --for=jsonpath='{.status.observedGeneration}'=1 \
  --timeout="${TIMEOUT_S}s" servingpolicy/qwen-arc
for object in deployment/qwen-arc service/qwen-arc networkpolicy/qwen-arc \
    configmap/qwen-arc-policy deployment/qwen-arc-router service/qwen-arc-router \
    serviceaccount/qwen-arc-router networkpolicy/qwen-arc-router; do
  "$KUBECTL" -n "$NAMESPACE" get "$object"
done
"$KUBECTL" -n "$NAMESPACE" get servingpolicy qwen-arc -o wide
echo "e2e: ServingPolicy reconciled"

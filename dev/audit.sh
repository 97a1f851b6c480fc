#!/usr/bin/env bash
# The security audit (SECURITY.md), run by `make audit`: checkov on the chart rendered with its
# default values and every ci/ variant, on the children the operator builds for the chart's
# default ServingPolicy (`python -m arc_operator.render`) and on images/*.Dockerfile, and bandit
# on the Python packages (medium and high findings fail). Any failed check fails the script;
# skips are annotated in place with their reason.
#
# Usage: dev/audit.sh HELM PYTHON SCANNER_BIN ROUTER_IMAGE (make audit passes them)
set -uo pipefail
helm=$1 python=$2 scanners=$3 router_image=$4
release=arc-serving
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT

"$helm" template "$release" charts/arc-serving --namespace "$release" > "$tmp/default.yaml" \
  && ARC_OPERATOR_ROUTER_IMAGE=$router_image \
    "$python" -m arc_operator.render "$tmp/default.yaml" "$tmp/operator-children" || exit 1
for values in charts/arc-serving/ci/*.yaml; do
  "$helm" template "$release" charts/arc-serving --namespace "$release" --values "$values" \
    > "$tmp/$(basename "$values")" || exit 1
done

status=0
echo "== checkov: chart rendered with default values and $(ls charts/arc-serving/ci/*.yaml | wc -l) ci/ variants, operator-built children"
"$scanners/checkov" --directory "$tmp" --framework kubernetes --compact --quiet --skip-download \
  || status=1
echo "== checkov: images/*.Dockerfile"
"$scanners/checkov" --directory images --framework dockerfile --compact --quiet --skip-download \
  || status=1
echo "== bandit: medium and high severity"
"$scanners/bandit" --recursive common/src arc_evictor/src simulator/src loadtest/src \
  operator/src harness/src dev/src cluster charts/arc-serving/dashboards -ll || status=1
if [ "$status" -eq 0 ]; then echo "make audit: clean"; else echo "make audit: FAILED" >&2; fi
exit $status

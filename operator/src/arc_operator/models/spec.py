"""The ServingPolicy spec: its pydantic models and ``parse_spec``, the operator's validation.

The models are the source of the CRD's spec schema (``arc_operator.crd``) and hold every
cross-field rule in a validator, so the operator, the CRD and the tests share one definition.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from arc_operator import PLURAL
from arc_operator.models.base import FrozenModel
from arc_serving_common.names import (
    API_KEY_ENV,
    CONFIG_ENV,
    KV_AWARE_ROUTER_TEMPERATURE,
    MAX_SESSION_AFFINITY_TTL_S,
    POLICY_ENV,
    POLICY_NAMES,
)

# Policy names as the custom resource spells them (upper case), generated from the shared
# names so that a new policy is valid here, in the CRD enum and in the docs at once.
Policy = enum.StrEnum("Policy", {name.upper(): name.upper() for name in POLICY_NAMES})


class SwitchMode(enum.StrEnum):
    """How a policy change reaches running pods."""

    HOT = "Hot"  # rewrite the policy ConfigMap; the plugin switches live, no restart
    RESTART = "Restart"  # rolling restart of the pods (maxUnavailable 0)


# The flag that turns vLLM's prefix caching off: owned, and what kv_aware routing cannot lose.
NO_PREFIX_CACHING = "--no-enable-prefix-caching"
# vLLM arguments the operator sets itself; engineArgs may not repeat or contradict them.
OWNED_ENGINE_ARGS = frozenset(
    {
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--block-size",
        "--enable-prefix-caching",
        NO_PREFIX_CACHING,
        "--num-gpu-blocks-override",
        "--gpu-memory-utilization",
        "--max-model-len",
        # The drain bound comes from disruption (requestSeconds), like the grace period it fits.
        "--shutdown-timeout",
        # The API key comes from a Secret through VLLM_API_KEY: on the command line it would be
        # readable by anyone who can list processes (/proc/PID/cmdline, ps) or read the pod spec.
        "--api-key",
    }
)
# Kubernetes' quantity syntax (k8s.io/apimachinery resource.Quantity), without a sign: a
# request is never negative. "four" fails here and in the CRD instead of at the API server.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# API_KEY_ENV is the variable vLLM reads its API key from (vllm.envs); the operator fills it
# from the Secret that apiKeySecretRef names, so env may not set it.
# Where vLLM, Hugging Face, torch and triton write (home, caches, temp files): the operator
# points them at the pod's emptyDirs, since the root filesystem is read-only.
WRITABLE_DIR_ENV = frozenset({"HOME", "TMPDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"})
# Telemetry off: vLLM reports usage statistics to its maintainers' server unless one of these
# is set (vllm.usage.usage_lib); a serving pod sends nothing it was not asked to.
NO_TELEMETRY_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# Environment variables the operator sets itself; env may not override them.
OWNED_ENV = (
    frozenset({CONFIG_ENV, POLICY_ENV, "PROMETHEUS_MULTIPROC_DIR", API_KEY_ENV})
    | WRITABLE_DIR_ENV
    | frozenset(NO_TELEMETRY_ENV)
)
# A Secret's name is a DNS subdomain (RFC 1123): lower-case labels joined by dots.
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
DNS_SUBDOMAIN_PATTERN = f"^{DNS_SUBDOMAIN}$"
# Kubernetes' label syntax (k8s.io/apimachinery/pkg/util/validation), which node selectors and
# tolerations follow: a label key is a qualified name, a name of at most 63 characters after an
# optional DNS subdomain prefix of at most 253 and "/"; a label value is empty or such a name.
MAX_LABEL_PREFIX = 253
MAX_LABEL_VALUE = 63
MAX_LABEL_KEY = MAX_LABEL_PREFIX + 1 + MAX_LABEL_VALUE
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY = f"({DNS_SUBDOMAIN}/)?{LABEL_NAME}"
LABEL_VALUE_PATTERN = f"^({LABEL_NAME})?$"
LABEL_KEY_SYNTAX = (
    f"a name of at most {MAX_LABEL_VALUE} characters (letters, digits, '-', '_' and '.', "
    "beginning and ending with a letter or digit), optionally after a DNS subdomain prefix of "
    f"at most {MAX_LABEL_PREFIX} characters and '/'"
)
# A Secret data key (Kubernetes' IsConfigMapKey); "." and ".." are refused by the validator.
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# The Secret data key that holds the API key when apiKeySecretRef names none.
DEFAULT_SECRET_KEY = "api-key"
# vLLM's GPU block tables are built for block sizes that are multiples of 16 tokens.
BLOCK_SIZE_MULTIPLE = 16
# The router reads --kv-event-block-size (always cache.blockSize) into a u32: a larger value
# stops it at start with an OverflowError (vllm-router 0.1.17, measured), and 0 is refused
# ("needs a nonzero block size"), which the minimum of 16 already excludes.
ROUTER_MAX_BLOCK_SIZE = 2**32 - 1


class RoutingPolicy(enum.StrEnum):
    """How clients reach the replicas: ``none`` (the Service NAME spreads connections) or one
    of the vLLM router's policies (its --policy choices, vllm-router 0.1.17)."""

    NONE = "none"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    CONSISTENT_HASH = "consistent_hash"
    POWER_OF_TWO = "power_of_two"
    CACHE_AWARE = "cache_aware"
    KV_AWARE = "kv_aware"
    STICKY_LEAST_LOADED = "sticky_least_loaded"


# The routing policy of a ServingPolicy with more than one replica that names none; one
# replica (or none) needs no router. docs/architecture.md, "Routing", records why.
DEFAULT_FLEET_ROUTING = RoutingPolicy.KV_AWARE
# kv_aware's --router-temperature unless routing.args gives one: the least cost still wins,
# but equal costs (a cold prompt on idle replicas) are drawn at random instead of all going
# to the first worker of the router's registry. docs/routing.md, "Measured on a local fleet".
ROUTER_TEMPERATURE = "--router-temperature"
DEFAULT_KV_AWARE_TEMPERATURE = f"{KV_AWARE_ROUTER_TEMPERATURE:g}"
# kv_aware's session affinity, off unless routing.args sets it; the router's bounds (docs/
# routing.md, "Router settings, and the default").
SESSION_AFFINITY_TTL = "--kv-aware-session-affinity-ttl-secs"
# Router flags the operator sets itself (docs/architecture.md, "Routing"); routing.args may
# not repeat or contradict them.
OWNED_ROUTER_ARGS = frozenset(
    {
        "--host",
        "--port",
        "--policy",
        "--worker-urls",
        "--kv-event-source",
        "--kv-event-replay-source",
        "--kv-event-block-size",
        "--kv-event-model",
        "--service-discovery",
        "--selector",
        "--service-discovery-port",
        "--service-discovery-namespace",
        "--prometheus-port",
        "--prometheus-host",
        # The key reaches the router as VLLM_API_KEY from apiKeySecretRef's Secret.
        "--api-key",
    }
)
# Router flags that switch it to another mode than one regular router over one ServingPolicy's
# pods: prefill/decode disaggregation (its workers, policies, selectors, KV connector and
# discovery), the multi-model gateway, and the Python MiniLB fallback.
CONFLICTING_ROUTER_ARGS = frozenset(
    {
        "--vllm-pd-disaggregation",
        "--prefill",
        "--decode",
        "--prefill-policy",
        "--decode-policy",
        "--pd-kv-events",
        "--prefill-selector",
        "--decode-selector",
        "--vllm-discovery-address",
        "--kv-connector",
        "--enable-igw",
        "--mini-lb",
    }
)
# vLLM flags the operator sets on the serving pods when routing is kv_aware: the KV event
# publisher the router subscribes to, and the scale-out endpoints through which it renders
# text prompts into tokens (/v1/completions/render).
KV_AWARE_ENGINE_ARGS = frozenset(
    {"--kv-events-config", "--enable-scale-out", "--no-enable-scale-out"}
)


def _flag_in(arg: str, flags: frozenset[str], *, underscores: bool) -> str | None:
    """The flag of ``flags`` that ``arg`` sets, if any, the way argparse reads it.

    argparse accepts any unambiguous prefix (``--block-si`` is ``--block-size``); no flag of
    vLLM or of the router outside each set is itself a prefix of a flag in it (tests check
    both parsers), so every prefix is refused. ``underscores``: vLLM's FlexibleArgumentParser
    also reads ``_`` as ``-`` in flag names; the router's plain argparse does not.
    """
    if not arg.startswith("--") or arg == "--":
        return None
    flag = arg.split("=", 1)[0]
    if underscores:
        flag = flag.replace("_", "-")
    return next((owned for owned in sorted(flags) if owned.startswith(flag)), None)


def router_arg(args: Sequence[str], flag: str) -> str | None:
    """The value router ``args`` give ``flag`` (the last one, as argparse keeps), "" for
    the flag with no value, None when they do not set it."""
    value = None
    for at, arg in enumerate(args):
        if _flag_in(arg, frozenset({flag}), underscores=False):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            else:
                value = args[at + 1] if at + 1 < len(args) else ""
    return value


def _is_temperature(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value >= 0


def _is_affinity_ttl(text: str) -> bool:
    return text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_SESSION_AFFINITY_TTL_S


def _owned_flag(arg: str) -> str | None:
    """The owned vLLM flag ``arg`` sets, if any (see ``_flag_in``)."""
    return _flag_in(arg, OWNED_ENGINE_ARGS, underscores=True)


class SpecError(ValueError):
    """A ServingPolicy spec the operator will not act on; the message names every problem."""


# Where a model volume is mounted, read-only, in the vLLM container.
MODEL_DIR = "/models"
# Set when the model comes from a volume: the pod must never reach for the Hub (air-gapped
# clusters), and a missing file then fails at once instead of after a download timeout.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}
# A volume's model path: the mount or a path beneath it, as the API server checks it (CEL).
MODEL_PATH_RULE = (
    f"self.name == '{MODEL_DIR}' || (self.name.startsWith('{MODEL_DIR}/') && "
    "!self.name.matches('(^|/)[.][.](/|$)'))"
)
MODEL_PATH_PROBLEM = (
    f"with model.volume, model.name must be an absolute path under {MODEL_DIR} (where the "
    "volume is mounted), without '..'"
)


def _climbs(path: str) -> bool:
    """Whether ``path`` has a ``..`` step (which could leave the directory it names)."""
    return ".." in path.split("/")


class PersistentVolumeClaimSource(FrozenModel):
    """A PersistentVolumeClaim in the ServingPolicy's namespace (Kubernetes' shape)."""

    claim_name: str = Field(
        max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the claim."
    )


class HostPathSource(FrozenModel):
    """A directory on the node (Kubernetes' shape); it must exist."""

    path: str = Field(
        max_length=4096, pattern=r"^/", description="Absolute path of the directory on the node."
    )

    @field_validator("path")
    @classmethod
    def _no_climbing(cls, path: str) -> str:
        if _climbs(path):
            raise ValueError(f"{path!r} may not contain '..'")
        return path


class ModelVolume(FrozenModel):
    """The volume holding the model: exactly one of persistentVolumeClaim or hostPath,
    always mounted read-only at /models."""

    # The same either-or rule for the API server (the CRD schema is generated from this).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [{"required": ["persistentVolumeClaim"]}, {"required": ["hostPath"]}]
        }
    )

    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        default=None, description="A PersistentVolumeClaim holding the model files."
    )
    host_path: HostPathSource | None = Field(
        default=None, description="A directory on every node that may run the pods."
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelVolume:
        if (self.persistent_volume_claim is None) == (self.host_path is None):
            raise ValueError("exactly one of persistentVolumeClaim or hostPath must be set")
        return self


class ModelSource(FrozenModel):
    """Which model the pods serve, and under which name the OpenAI API exposes it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": f"!has(self.volume) || ({MODEL_PATH_RULE})", "message": MODEL_PATH_PROBLEM}
            ]
        }
    )

    name: str = Field(
        min_length=1,
        description=f"Hugging Face model id or a path in the image; with volume, a path under "
        f"{MODEL_DIR}.",
    )
    served_name: str | None = Field(
        default=None,
        min_length=1,
        description="Model name clients send in requests (default: the model name).",
    )

    volume: ModelVolume | None = Field(
        default=None,
        description=f"Volume holding the model, mounted read-only at {MODEL_DIR}; the pods then "
        "run with HF_HUB_OFFLINE=1.",
    )

    @model_validator(mode="after")
    def _name_in_volume(self) -> ModelSource:
        if self.volume is None:
            return self
        inside = self.name == MODEL_DIR or self.name.startswith(f"{MODEL_DIR}/")
        if not inside or _climbs(self.name):
            raise ValueError(f"{MODEL_PATH_PROBLEM}, got {self.name!r}")
        return self

    @property
    def served(self) -> str:
        """The name clients use: servedName, or the model name when unset."""
        return self.served_name or self.name


class CacheSpec(FrozenModel):
    """The KV-cache size: exactly one of numBlocks or gpuMemoryUtilization is set."""

    # The same either-or rule for the API server (the CRD schema is generated from this).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [{"required": ["numBlocks"]}, {"required": ["gpuMemoryUtilization"]}]
        }
    )

    block_size: int = Field(
        default=16,
        ge=BLOCK_SIZE_MULTIPLE,
        le=ROUTER_MAX_BLOCK_SIZE,
        multiple_of=BLOCK_SIZE_MULTIPLE,
        description="Tokens per KV block (a positive multiple of 16, at most 4294967295: the "
        "router's KV event block size, which always equals it, is a 32-bit integer).",
    )
    num_blocks: int | None = Field(
        default=None, ge=1, description="Fixed number of KV blocks (--num-gpu-blocks-override)."
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Fraction of GPU memory vLLM may use (--gpu-memory-utilization).",
    )

    @model_validator(mode="after")
    def _exactly_one_size(self) -> CacheSpec:
        if (self.num_blocks is None) == (self.gpu_memory_utilization is None):
            raise ValueError("exactly one of numBlocks or gpuMemoryUtilization must be set")
        return self


class ResourcesSpec(FrozenModel):
    """What each vLLM pod asks the scheduler for."""

    gpus: int = Field(default=1, ge=0, description="NVIDIA GPUs per pod (nvidia.com/gpu).")
    # Defaults: vLLM's API server, engine core and tokenizer processes keep a few cores busy,
    # and host memory holds the weights while loading plus the CPU swap space (4 GiB by
    # default), so 4 cores and 32Gi fit a 7-8B model on one GPU; bigger models set more.
    cpu: str = Field(
        default="4",
        pattern=QUANTITY_PATTERN,
        description="CPU request and limit (a Kubernetes quantity: 4, 500m).",
    )
    memory: str = Field(
        default="32Gi",
        pattern=QUANTITY_PATTERN,
        description="Memory request and limit (a Kubernetes quantity: 16Gi, 512M).",
    )
    home_size_limit: str = Field(
        default="64Gi",
        pattern=QUANTITY_PATTERN,
        description=(
            "Size limit of the writable HOME emptyDir (Hugging Face downloads, vLLM and torch "
            "caches); the kubelet evicts a pod that exceeds it. Fit it to the model's size."
        ),
    )


class EnvVar(FrozenModel):
    """An environment variable for the vLLM container (Kubernetes EnvVar shape)."""

    name: str = Field(min_length=1, description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None, description="A Kubernetes EnvVarSource (secretKeyRef, ...)."
    )

    @model_validator(mode="after")
    def _source_shape(self) -> EnvVar:
        # valueFrom is free-form in the CRD (preserved fields), so its shape is checked here:
        # otherwise a typo passes validation and the Deployment is refused at every reconcile.
        if self.value_from is None:
            return self
        if self.value is not None:
            raise ValueError(f"env {self.name!r}: set value or valueFrom, not both")
        sources = sorted(self.value_from)
        if len(sources) != 1 or sources[0] not in ENV_SOURCES:
            raise ValueError(
                f"env {self.name!r}: valueFrom needs exactly one of {', '.join(ENV_SOURCES)}, "
                f"got {sources}"
            )
        source, ref = sources[0], self.value_from[sources[0]]
        required, optional = ENV_SOURCES[source]
        fields = {**required, **optional}
        if not isinstance(ref, dict) or not set(required) <= set(ref) <= set(fields):
            raise ValueError(
                f"env {self.name!r}: valueFrom.{source} needs {', '.join(required)} "
                f"(may have {', '.join(optional)})"
            )
        for key, value in ref.items():
            if not isinstance(value, fields[key]) or (fields[key] is str and not value):
                raise ValueError(f"env {self.name!r}: valueFrom.{source}.{key} has a wrong type")
        return self


# Kubernetes' EnvVarSource (core/v1, 1.33): source -> (required fields, optional fields) with
# their JSON types (a resource divisor is a quantity: a string or a number).
ENV_SOURCES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "configMapKeyRef": ({"key": str}, {"name": str, "optional": bool}),
    "fieldRef": ({"fieldPath": str}, {"apiVersion": str}),
    "resourceFieldRef": ({"resource": str}, {"containerName": str, "divisor": str | int}),
    "secretKeyRef": ({"key": str}, {"name": str, "optional": bool}),
}


def _label_key(key: str) -> str:
    """``key`` if it is a Kubernetes label key; ValueError naming the syntax otherwise (the
    pattern bounds the name; the prefix's length is checked apart, as the CEL rules do)."""
    if re.fullmatch(LABEL_KEY, key) is None or key.find("/") > MAX_LABEL_PREFIX:
        raise ValueError(f"{key!r} is not a label key: {LABEL_KEY_SYNTAX}")
    return key


def _label_keys(labels: dict[str, str]) -> dict[str, str]:
    for key in labels:
        _label_key(key)
    return labels


# Placement entries one list may hold: beyond any real node's labels and taints, and a bound
# the API server needs to accept the CEL rules over them (it estimates their cost from it).
MAX_NODE_SELECTOR = 64
MAX_TOLERATIONS = 64
LabelValue = Annotated[
    str, StringConstraints(max_length=MAX_LABEL_VALUE, pattern=LABEL_VALUE_PATTERN)
]
# A map's keys have no schema in a CRD: the API server checks them with a CEL rule.
NodeSelector = Annotated[
    dict[str, LabelValue],
    Field(
        max_length=MAX_NODE_SELECTOR,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, k.matches(r'^{LABEL_KEY}$') && "
                    f"k.indexOf('/') <= {MAX_LABEL_PREFIX})",
                    "message": f"every key must be a label key: {LABEL_KEY_SYNTAX}",
                }
            ]
        },
    ),
    AfterValidator(_label_keys),
]


class TolerationOperator(enum.StrEnum):
    """How a toleration matches a taint's value, as in Kubernetes (empty means Equal). The
    comparison operators Lt and Gt are alpha in Kubernetes 1.35, behind a feature gate."""

    UNSET = ""
    EQUAL = "Equal"
    EXISTS = "Exists"


class TaintEffect(enum.StrEnum):
    """The taint effect a toleration matches; empty matches every effect."""

    ANY = ""
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


# The API server's rules for a pod's tolerations (ValidateTolerations, Kubernetes 1.35) that a
# field schema cannot hold, worded once for the operator's check and the CRD's CEL rules.
KEYLESS_PROBLEM = "operator must be Exists when key is empty (which tolerates every taint)"
EXISTS_VALUE_PROBLEM = "value must be empty when operator is Exists"
SECONDS_PROBLEM = "tolerationSeconds needs effect NoExecute"
TOLERATION_RULES = [
    {
        "rule": "(has(self.key) && self.key != '') || "
        "(has(self.operator) && self.operator == 'Exists')",
        "message": KEYLESS_PROBLEM,
    },
    {
        "rule": "!has(self.operator) || self.operator != 'Exists' || "
        "!has(self.value) || self.value == ''",
        "message": EXISTS_VALUE_PROBLEM,
    },
    {
        "rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "message": SECONDS_PROBLEM,
    },
    {
        "rule": f"!has(self.key) || self.key.indexOf('/') <= {MAX_LABEL_PREFIX}",
        "message": f"key must be a label key: {LABEL_KEY_SYNTAX}",
    },
]


class Toleration(FrozenModel):
    """A Kubernetes toleration (core/v1 Toleration), checked as the API server checks a pod's.

    A key is a label key, and without one the operator is Exists; Exists takes no value, Equal
    a label value; tolerationSeconds only with effect NoExecute.
    """

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": TOLERATION_RULES})

    # Checked by _label_key (its message names the syntax); the API server by the schema.
    key: str | None = Field(
        default=None,
        json_schema_extra={"maxLength": MAX_LABEL_KEY, "pattern": f"^({LABEL_KEY})?$"},
        description="Taint key (a label key); empty, with operator Exists, matches every taint.",
    )
    operator: TolerationOperator | None = Field(
        default=None,
        description="Equal (also when empty) matches the key and value; Exists any value.",
    )
    value: LabelValue | None = Field(
        default=None, description="Taint value (a label value) for Equal; empty for Exists."
    )
    effect: TaintEffect | None = Field(
        default=None,
        description="Effect to match: NoSchedule, PreferNoSchedule or NoExecute; empty matches "
        "every effect.",
    )
    toleration_seconds: int | None = Field(
        default=None,
        json_schema_extra={"format": "int64"},
        description="With effect NoExecute, how long the pod stays on a node after the taint "
        "appears (unset: for good; 0 or less: evicted at once).",
    )

    @field_validator("key")
    @classmethod
    def _key_is_a_label_key(cls, key: str | None) -> str | None:
        return _label_key(key) if key else key

    @model_validator(mode="after")
    def _kubernetes_rules(self) -> Toleration:
        exists = self.operator is TolerationOperator.EXISTS
        problems = []
        if not self.key and not exists:
            problems.append(KEYLESS_PROBLEM)
        if exists and self.value:
            problems.append(EXISTS_VALUE_PROBLEM)
        if self.toleration_seconds is not None and self.effect is not TaintEffect.NO_EXECUTE:
            problems.append(SECONDS_PROBLEM)
        if problems:
            raise ValueError("; ".join(problems))
        return self


Tolerations = Annotated[list[Toleration], Field(max_length=MAX_TOLERATIONS)]


class SecretKeyRef(FrozenModel):
    """A key of a Secret in the ServingPolicy's namespace.

    The operator never reads the Secret (it has no RBAC on Secrets): the pod's env names it
    with ``secretKeyRef`` and the kubelet resolves it when the container starts.
    """

    name: str = Field(
        max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Name of the Secret."
    )
    key: str = Field(
        default=DEFAULT_SECRET_KEY,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Data key in the Secret that holds the value.",
    )

    @field_validator("key")
    @classmethod
    def _not_a_path_step(cls, key: str) -> str:
        if key in {".", ".."}:
            raise ValueError(f"{key!r} is not a valid Secret data key")
        return key


class RouterResources(FrozenModel):
    """What each router pod asks the scheduler for; requests equal limits."""

    cpu: str = Field(
        default="1",
        pattern=QUANTITY_PATTERN,
        description="CPU request and limit per router pod (a Kubernetes quantity).",
    )
    memory: str = Field(
        default="1Gi",
        pattern=QUANTITY_PATTERN,
        description="Memory request and limit per router pod (a Kubernetes quantity).",
    )


class RoutingSpec(FrozenModel):
    """The vLLM router in front of the replicas (docs/architecture.md, "Routing")."""

    policy: RoutingPolicy | None = Field(
        default=None,
        description="none (clients use the Service NAME) or the router's policy: round_robin, "
        "random, consistent_hash, power_of_two, cache_aware, kv_aware, sticky_least_loaded. "
        f"Default: {DEFAULT_FLEET_ROUTING.value} with more than one replica, else none.",
    )
    replicas: int = Field(default=1, ge=1, le=2**31 - 1, description="Router pods.")
    resources: RouterResources = Field(
        default_factory=RouterResources, description="Per router pod CPU and memory."
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Router image (default: the operator's ARC_OPERATOR_ROUTER_IMAGE).",
    )
    args: list[str] = Field(
        default_factory=list,
        description="Extra router arguments, appended after the ones the operator sets.",
    )
    # The router's placement is its own: CPU-only router pods should not need, or take, the
    # GPU nodes' labels and tolerations the vLLM pods have.
    node_selector: NodeSelector = Field(
        default_factory=dict,
        description="Node labels the router pods require (their nodeSelector); none by "
        "default: the vLLM pods' are not copied.",
    )
    tolerations: Tolerations = Field(
        default_factory=list,
        description="Taints the router pods tolerate (Kubernetes tolerations); none by default.",
    )


# A worst-case request's decode rate when disruption.requestSeconds is unset: maxModelLen
# tokens at this many tokens per second (a slow GPU's single-request decode; CPU pods with
# long contexts should set requestSeconds).
WORST_CASE_TOKENS_PER_S = 50
# A Kubernetes duration field is an int64 of seconds, but a day bounds every wait here.
MAX_WAIT_S = 86400


class DisruptionSpec(FrozenModel):
    """How pods leave without losing a request: the PodDisruptionBudgets' size, the preStop
    wait and the drain bound (docs/operator.md, "Disruptions")."""

    max_unavailable: int = Field(
        default=1,
        ge=1,
        le=2**31 - 1,
        description="Serving pods a voluntary disruption (a node drain, an eviction) may take "
        "at once: the PodDisruptionBudget's maxUnavailable when replicas > 1. At least 1, so "
        "that a drain can always proceed.",
    )
    drain_delay_seconds: int = Field(
        default=5,
        ge=0,
        le=MAX_WAIT_S,
        description="Longest preStop wait of a leaving pod for the Service endpoints and the "
        "router to stop sending it requests, before it gets SIGTERM; a serving pod ends the "
        "wait earlier once no request has arrived for 2 s.",
    )
    request_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_WAIT_S,
        description="Worst-case time of one request: how long a leaving pod drains the "
        "requests it holds (vLLM --shutdown-timeout). Default: maxModelLen tokens at "
        f"{WORST_CASE_TOKENS_PER_S} tokens/s, rounded up.",
    )


# The API is closed by default: serving without a key must be asked for by name.
API_KEY_CHOICE = (
    "set apiKeySecretRef (the Secret holding the API key) or allowUnauthenticated: true "
    "to serve the API without a key, exactly one of them"
)


class ServingPolicySpec(FrozenModel):
    """The desired state of one vLLM serving deployment and its eviction policy.

    Invariants (checked here, so every consumer sees them): exactly one cache size;
    with numBlocks, one full-length request fits in the cache (numBlocks * blockSize >=
    maxModelLen), otherwise the pod could never serve a long prompt; engineArgs and env
    do not touch the arguments and variables the operator owns; the API is closed by
    default: exactly one of apiKeySecretRef or ``allowUnauthenticated: true`` is set;
    routing.args set no router flag the operator owns or one that selects another router
    mode; with kv_aware routing, prefix caching stays on and engineArgs leave the KV event
    and scale-out flags to the operator.
    """

    plural: ClassVar[str] = PLURAL
    # The API server checks the cache-size rule too (CEL); the operator's check stays the
    # authority for clusters whose CRD is older than the operator.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.cache.numBlocks) || "
                    "self.cache.numBlocks * self.cache.blockSize >= self.maxModelLen",
                    "message": "cache.numBlocks * cache.blockSize must be at least maxModelLen "
                    "(one full-length request must fit in the cache)",
                },
                {
                    "rule": "has(self.apiKeySecretRef) != "
                    "(has(self.allowUnauthenticated) && self.allowUnauthenticated)",
                    "message": API_KEY_CHOICE,
                },
            ]
        }
    )

    model: ModelSource = Field(description="The model the pods serve.")
    image: str = Field(min_length=1, description="vLLM image with the arc-evictor plugin.")
    # The Deployment field is an int32.
    replicas: int = Field(default=1, ge=0, le=2**31 - 1, description="Number of vLLM pods.")
    policy: Policy = Field(default=Policy("LRU"), description="Prefix-cache eviction policy.")
    switch_mode: SwitchMode = Field(
        default=SwitchMode.HOT,
        description="Hot: pods switch policy live; Restart: rolling restart on a policy change.",
    )
    cache: CacheSpec = Field(description="KV-cache block size and size.")
    max_model_len: int = Field(ge=1, description="Longest request in tokens (--max-model-len).")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Per-pod GPU, CPU and memory."
    )
    node_selector: NodeSelector = Field(
        default_factory=dict,
        description="Node labels the vLLM pods require (their nodeSelector), e.g. a GPU node "
        "pool's.",
    )
    tolerations: Tolerations = Field(
        default_factory=list,
        description="Taints the vLLM pods tolerate (Kubernetes tolerations), e.g. "
        "nvidia.com/gpu:NoSchedule on GPU nodes.",
    )
    engine_args: list[str] = Field(
        default_factory=list, description="Extra vLLM arguments, appended after the owned ones."
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Extra environment variables for the vLLM container."
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the API key clients must send as 'Authorization: "
        f"Bearer KEY' on /v1 (the pods read it from env {API_KEY_ENV} at start).",
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="Serve /v1 without an API key: anyone who reaches the Service can use "
        "the model. Required (true) when apiKeySecretRef is not set.",
    )
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec,
        description="The vLLM router in front of the replicas (Deployment NAME-router).",
    )
    disruption: DisruptionSpec = Field(
        default_factory=DisruptionSpec,
        description="Disruption budget, preStop wait and drain bound of the pods.",
    )

    @model_validator(mode="after")
    def _servable(self) -> ServingPolicySpec:
        problems: list[str] = []
        if (
            self.cache.num_blocks is not None
            and self.cache.num_blocks * self.cache.block_size < self.max_model_len
        ):
            problems.append(
                f"cannot serve maxModelLen={self.max_model_len}: the cache holds only "
                f"numBlocks*blockSize={self.cache.num_blocks * self.cache.block_size} tokens"
            )
        owned_args = sorted({flag for arg in self.engine_args if (flag := _owned_flag(arg))})
        if self.routing_policy is RoutingPolicy.KV_AWARE:
            problems += self._kv_aware_problems(owned_args)
            # Reported there, with the reason kv_aware needs prefix caching.
            owned_args = [flag for flag in owned_args if flag != NO_PREFIX_CACHING]
        problems += self._router_arg_problems()
        if "--api-key" in owned_args:
            owned_args.remove("--api-key")
            problems.append(
                "engineArgs may not set --api-key (the command line is visible in the process "
                "list; name the key's Secret in apiKeySecretRef)"
            )
        if owned_args:
            problems.append(
                f"engineArgs may not set {', '.join(owned_args)} (set by the operator from spec)"
            )
        owned_env = sorted({var.name for var in self.env} & OWNED_ENV)
        if owned_env:
            problems.append(f"env may not set {', '.join(owned_env)} (set by the operator)")
        offline_env = sorted({var.name for var in self.env} & set(OFFLINE_ENV))
        if self.model.volume is not None and offline_env:
            problems.append(
                f"env may not set {', '.join(offline_env)} (set by the operator when "
                "model.volume is set)"
            )
        if self.api_key_secret_ref is None and not self.allow_unauthenticated:
            problems.append(
                "apiKeySecretRef is required (the API is closed by default): name the Secret "
                "holding the API key, or set allowUnauthenticated: true to serve without one"
            )
        elif self.api_key_secret_ref is not None and self.allow_unauthenticated:
            problems.append("set apiKeySecretRef or allowUnauthenticated: true, not both")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _kv_aware_problems(self, owned_args: Sequence[str]) -> list[str]:
        """kv_aware routes by the pods' prefix-cache events: prefix caching must stay on
        (``owned_args``, the owned flags engineArgs set, must not hold
        ``NO_PREFIX_CACHING``), and the event publisher and scale-out endpoints are the
        operator's."""
        problems = []
        if NO_PREFIX_CACHING in owned_args:
            problems.append(
                "engineArgs may not set --no-enable-prefix-caching: routing.policy kv_aware "
                "routes by the pods' prefix-cache events"
            )
        kv_args = sorted(
            {
                flag
                for arg in self.engine_args
                if (flag := _flag_in(arg, KV_AWARE_ENGINE_ARGS, underscores=True))
            }
        )
        if kv_args:
            problems.append(
                f"engineArgs may not set {', '.join(kv_args)} (set by the operator when "
                "routing.policy is kv_aware)"
            )
        return problems

    def _router_arg_problems(self) -> list[str]:
        args = self.routing.args
        owned = sorted(
            {flag for arg in args if (flag := _flag_in(arg, OWNED_ROUTER_ARGS, underscores=False))}
        )
        problems = []
        if "--api-key" in owned:
            owned.remove("--api-key")
            problems.append(
                "routing.args may not set --api-key (the router reads the key from "
                f"apiKeySecretRef's Secret through {API_KEY_ENV})"
            )
        if owned:
            problems.append(
                f"routing.args may not set {', '.join(owned)} (set by the operator from spec)"
            )
        modes = sorted(
            {
                flag
                for arg in args
                if (flag := _flag_in(arg, CONFLICTING_ROUTER_ARGS, underscores=False))
            }
        )
        if modes:
            problems.append(
                f"routing.args may not set {', '.join(modes)} (another router mode than one "
                "router over this ServingPolicy's pods)"
            )
        temperature = router_arg(args, ROUTER_TEMPERATURE)
        if temperature is not None and not _is_temperature(temperature):
            problems.append(
                f"routing.args: {ROUTER_TEMPERATURE} must be a number >= 0, got {temperature!r}"
            )
        ttl = router_arg(args, SESSION_AFFINITY_TTL)
        if ttl is not None and not _is_affinity_ttl(ttl):
            problems.append(
                f"routing.args: {SESSION_AFFINITY_TTL} must be whole seconds from 1 to "
                f"{MAX_SESSION_AFFINITY_TTL_S}, got {ttl!r}"
            )
        return problems

    @property
    def policy_name(self) -> str:
        """The lower-case policy name the plugin and its metrics use."""
        return self.policy.value.lower()

    @property
    def request_seconds(self) -> int:
        """The worst-case request time: disruption.requestSeconds, or maxModelLen tokens at
        WORST_CASE_TOKENS_PER_S, rounded up."""
        if self.disruption.request_seconds is not None:
            return self.disruption.request_seconds
        return -(-self.max_model_len // WORST_CASE_TOKENS_PER_S)

    @property
    def routing_policy(self) -> RoutingPolicy:
        """The effective routing policy: routing.policy, or DEFAULT_FLEET_ROUTING with more
        than one replica and none otherwise."""
        if self.routing.policy is not None:
            return self.routing.policy
        return DEFAULT_FLEET_ROUTING if self.replicas > 1 else RoutingPolicy.NONE


def _describe(error: ValidationError) -> str:
    """One line per problem, each naming the spec field by its camelCase path, list items by
    index as the API server does (``spec.tolerations[0].key``)."""
    lines = []
    for item in error.errors():
        path = "spec"
        for part in item["loc"]:
            path += f"[{part}]" if isinstance(part, int) else f".{part}"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}")
    return "; ".join(lines)


# The API server keeps integers as int64; a larger one is refused before the operator sees it.
INT64 = (-(2**63), 2**63 - 1)


def _not_json(value: Any, path: str) -> list[str]:
    """Problems, by path, of values the API server cannot hold: integers beyond int64,
    NaN and infinities, and anything that is not JSON data."""
    if isinstance(value, Mapping):
        return [bad for key, item in value.items() for bad in _not_json(item, f"{path}.{key}")]
    if isinstance(value, list):
        return [bad for i, item in enumerate(value) for bad in _not_json(item, f"{path}.{i}")]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, int):
        return [] if INT64[0] <= value <= INT64[1] else [f"{path}: integer out of the int64 range"]
    if isinstance(value, float):
        return [] if math.isfinite(value) else [f"{path}: {value} is not a JSON number"]
    return [f"{path}: a {type(value).__name__} is not JSON data"]


def _without_nulls(value: Any) -> Any:
    """``value`` with null object fields dropped, as the API server prunes them (a CRD schema
    without ``nullable``): ``replicas: null`` means the default, as it does in the cluster."""
    if isinstance(value, Mapping):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def parse_spec(spec: Mapping[str, Any]) -> ServingPolicySpec:
    """Validate a raw spec; raise SpecError naming every problem (nothing else is raised).

    Validation is strict and as JSON, the way the API server checks the CRD schema: ``"3"`` is
    not an integer, ``true`` is not 1 and ``"true"`` is not a boolean (pydantic's lax mode
    would coerce all three, accepting specs the API server refuses). Unknown fields are refused
    by name, where the API server would drop them silently.
    """
    if not isinstance(spec, Mapping):
        raise SpecError(f"spec: expected an object, got {type(spec).__name__}")
    problems = _not_json(spec, "spec")
    if problems:
        raise SpecError("; ".join(problems))
    try:
        text = json.dumps(_without_nulls(spec), allow_nan=False)
    except (TypeError, ValueError) as error:  # a key that is not a string
        raise SpecError(f"spec: not JSON data ({error})") from None
    try:
        return ServingPolicySpec.model_validate_json(text, strict=True)
    except ValidationError as error:
        raise SpecError(_describe(error)) from None

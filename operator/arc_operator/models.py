"""Pydantic models of the ServingPolicy spec and of the operator's own settings.

The models are the single source of truth for the CRD schema (``arc_operator.crd`` generates
it from them) and for the operator's validation of a spec. They are frozen and do no I/O:
everything they need is in the spec itself, so a test can build them from plain dicts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from arc_evictor.policies import policy_names
from arc_operator import PLURAL

# Policy names as the custom resource spells them (upper case), generated from the policy
# registry so that a new policy is valid here, in the CRD enum and in the docs at once.
Policy = enum.StrEnum("Policy", {name.upper(): name.upper() for name in policy_names()})


class SwitchMode(enum.StrEnum):
    """How a policy change reaches running pods."""

    HOT = "Hot"  # rewrite the policy ConfigMap; the plugin switches live, no restart
    RESTART = "Restart"  # rolling restart of the pods (maxUnavailable 0)


# vLLM arguments the operator sets itself; engineArgs may not repeat or contradict them.
OWNED_ENGINE_ARGS = frozenset(
    {
        "--host",
        "--port",
        "--model",
        "--served-model-name",
        "--block-size",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--num-gpu-blocks-override",
        "--gpu-memory-utilization",
        "--max-model-len",
    }
)
# Kubernetes' quantity syntax (k8s.io/apimachinery resource.Quantity), without a sign: a
# request is never negative. "four" fails here and in the CRD instead of at the API server.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# Environment variables the operator sets itself; env may not override them.
OWNED_ENV = frozenset({"ARC_EVICTOR_CONFIG", "ARC_EVICTOR_POLICY", "PROMETHEUS_MULTIPROC_DIR"})
# vLLM's GPU block tables are built for block sizes that are multiples of 16 tokens.
BLOCK_SIZE_MULTIPLE = 16


def _owned_flag(arg: str) -> str | None:
    """The owned vLLM flag ``arg`` sets, if any, the way vLLM's parser reads it.

    vLLM's FlexibleArgumentParser turns ``_`` into ``-`` in flag names, and argparse accepts
    any unambiguous prefix (``--block-si`` is ``--block-size``); no vLLM flag is itself a
    prefix of an owned one, so every prefix of an owned flag is refused.
    """
    if not arg.startswith("--") or arg == "--":
        return None
    flag = arg.split("=", 1)[0].replace("_", "-")
    return next((owned for owned in sorted(OWNED_ENGINE_ARGS) if owned.startswith(flag)), None)


class SpecError(ValueError):
    """A ServingPolicy spec the operator will not act on; the message names every problem."""


class _Frozen(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
    )


class ModelSource(_Frozen):
    """Which model the pods serve, and under which name the OpenAI API exposes it."""

    name: str = Field(min_length=1, description="Hugging Face model id or a path in the image.")
    served_name: str | None = Field(
        default=None,
        min_length=1,
        description="Model name clients send in requests (default: the model name).",
    )

    @property
    def served(self) -> str:
        """The name clients use: servedName, or the model name when unset."""
        return self.served_name or self.name


class CacheSpec(_Frozen):
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
        multiple_of=BLOCK_SIZE_MULTIPLE,
        description="Tokens per KV block (a positive multiple of 16).",
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


class ResourcesSpec(_Frozen):
    """What each vLLM pod asks the scheduler for."""

    gpus: int = Field(default=1, ge=0, description="NVIDIA GPUs per pod (nvidia.com/gpu).")
    cpu: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="CPU request and limit (a Kubernetes quantity: 4, 500m).",
    )
    memory: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Memory request and limit (a Kubernetes quantity: 16Gi, 512M).",
    )


class EnvVar(_Frozen):
    """An environment variable for the vLLM container (Kubernetes EnvVar shape)."""

    name: str = Field(min_length=1, description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None, description="A Kubernetes EnvVarSource (secretKeyRef, ...)."
    )


class ServingPolicySpec(_Frozen):
    """The desired state of one vLLM serving deployment and its eviction policy.

    Invariants (checked here, so every consumer sees them): exactly one cache size;
    with numBlocks, one full-length request fits in the cache (numBlocks * blockSize >=
    maxModelLen), otherwise the pod could never serve a long prompt; engineArgs and env
    do not touch the arguments and variables the operator owns.
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
                }
            ]
        }
    )

    model: ModelSource = Field(description="The model the pods serve.")
    image: str = Field(min_length=1, description="vLLM image with the arc-evictor plugin.")
    replicas: int = Field(default=1, ge=0, description="Number of vLLM pods.")
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
    engine_args: list[str] = Field(
        default_factory=list, description="Extra vLLM arguments, appended after the owned ones."
    )
    env: list[EnvVar] = Field(
        default_factory=list, description="Extra environment variables for the vLLM container."
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
        if owned_args:
            problems.append(
                f"engineArgs may not set {', '.join(owned_args)} (set by the operator from spec)"
            )
        owned_env = sorted({var.name for var in self.env} & OWNED_ENV)
        if owned_env:
            problems.append(f"env may not set {', '.join(owned_env)} (set by the operator)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def policy_name(self) -> str:
        """The lower-case policy name the plugin and its metrics use."""
        return self.policy.value.lower()


class ConditionStatus(enum.StrEnum):
    """Kubernetes condition status values."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Phase(enum.StrEnum):
    """One-word summary of a ServingPolicy; the conditions carry the detail."""

    PROGRESSING = "Progressing"  # children applied; pods rolling out or switching policy
    READY = "Ready"  # every pod ready and reporting the spec's policy
    STOPPED = "Stopped"  # replicas is 0
    INVALID = "Invalid"  # the spec is invalid; running pods are left as they were


class Condition(_Frozen):
    """One status condition; lastTransitionTime changes only when status changes."""

    type: str = Field(description="Valid, PolicyApplied or Ready.")
    status: ConditionStatus
    reason: str = Field(description="CamelCase reason.")
    message: str = ""
    last_transition_time: str = Field(
        json_schema_extra={"format": "date-time"}, description="RFC 3339 time."
    )
    observed_generation: int | None = None


class ServingPolicyStatus(_Frozen):
    """What the operator observed; written by every reconcile and by the status timer."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation of the spec last reconciled."
    )
    phase: Phase = Field(description="Summary of the conditions.")
    replicas: int = Field(default=0, description="Pods the Deployment has.")
    ready_replicas: int = Field(default=0, description="Pods passing their readiness probe.")
    active_policy: str | None = Field(
        default=None,
        description="Policy the pods report on /metrics (comma-separated while they differ).",
    )
    hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Prefix-cache hit rate (tokens) over the last status interval.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


def _describe(error: ValidationError) -> str:
    """One line per problem, each naming the spec field by its camelCase path."""
    lines = []
    for item in error.errors():
        path = ".".join(["spec", *(str(part) for part in item["loc"])])
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}")
    return "; ".join(lines)


def parse_spec(spec: Mapping[str, Any]) -> ServingPolicySpec:
    """Validate a raw spec; raise SpecError naming every problem (nothing else is raised)."""
    try:
        return ServingPolicySpec.model_validate(dict(spec))
    except ValidationError as error:
        raise SpecError(_describe(error)) from None


class OperatorConfig(_Frozen):
    """The operator's own settings, read once from the environment at start-up."""

    env_names: ClassVar[dict[str, str]] = {
        "metrics_port": "ARC_OPERATOR_METRICS_PORT",
        "status_interval": "ARC_OPERATOR_STATUS_INTERVAL",
        "scrape_timeout": "ARC_OPERATOR_SCRAPE_TIMEOUT",
    }

    metrics_port: int = Field(default=8000, ge=1, le=65535)
    status_interval: float = Field(default=30.0, gt=0)
    scrape_timeout: float = Field(default=5.0, gt=0)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> OperatorConfig:
        """Read the settings; raise SpecError naming the variable for a bad value."""
        values = {field: environ[var] for field, var in cls.env_names.items() if environ.get(var)}
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            problems = [
                f"{cls.env_names[str(item['loc'][0])]}={values[str(item['loc'][0])]!r}: "
                f"{item['msg']}"
                for item in error.errors()
            ]
            raise SpecError("invalid operator settings: " + "; ".join(problems)) from None

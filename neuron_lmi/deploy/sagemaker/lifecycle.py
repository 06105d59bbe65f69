"""Changing and removing a deployment: ``update`` and ``delete``.

An endpoint config is immutable. Updating a plain endpoint therefore creates a new config (and a new
model when the image, data or environment changed) named ``<name>-<version>`` and points the
endpoint at it with UpdateEndpoint; SageMaker starts the new instances and shifts traffic before it
retires the old ones. The previous config and model stay, for a rollback. An inference component is
updated in place with UpdateInferenceComponent (model, resources, copy count).

``delete`` removes what ``create`` made, in dependency order, and skips what is already gone, so a
half-finished ``create`` can be cleaned up: for each inference component its scalable target and
scale-from-zero alarm, then the component (waiting until it is gone), the endpoint, its config, and
the models the variant and the components used.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError

from neuron_lmi.deploy.sagemaker.resources import (
    EndpointConfigSpec,
    InferenceComponentSpec,
    create_endpoint_config,
    wait_for_component,
    wait_for_endpoint,
)
from neuron_lmi.deploy.sagemaker.scaling import ScaleFromZeroSpec, component_resource

NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")  # SageMaker's pattern for these names


def versioned(name: str, version: str) -> str:
    """``mistral`` + ``20260101`` → ``mistral-20260101``, checked against SageMaker's name pattern."""
    full = f"{name}-{version}"
    if not NAME.fullmatch(full):
        raise ValueError(f"version={version!r}: {full!r} is not a valid SageMaker name (63 chars, a-z0-9-)")
    return full


def _missing(exc: ClientError) -> bool:
    """SageMaker answers ValidationException "Could not find ..."; the others have their own code."""
    error = exc.response.get("Error", {})
    code, message = error.get("Code", ""), error.get("Message", "")
    return code in ("ObjectNotFoundException", "ResourceNotFound") or (
        code == "ValidationException" and "could not find" in message.lower()
    )


def tolerate_missing(call: Callable[..., Any], **kwargs: Any) -> Any | None:
    try:
        return call(**kwargs)
    except ClientError as exc:
        if _missing(exc):
            return None
        raise


@dataclass(frozen=True, slots=True)
class Deployment:
    """What an endpoint runs: its config, the variant's models, and its inference components."""

    endpoint: str | None
    config: str | None
    models: tuple[str, ...] = ()
    components: dict[str, dict[str, Any]] = field(default_factory=dict)  # component -> its Specification
    variant: dict[str, Any] = field(default_factory=dict)  # the config's first production variant
    role: str | None = None  # the config's execution role (inference-component endpoints)


def describe_deployment(sagemaker: Any, endpoint: str) -> Deployment:
    """Read the endpoint, its config and components. Without an endpoint, a config and a model of
    the same name (left by an interrupted ``create``) are looked for instead."""
    described = tolerate_missing(sagemaker.describe_endpoint, EndpointName=endpoint)
    config = described["EndpointConfigName"] if described else endpoint
    config_desc = tolerate_missing(sagemaker.describe_endpoint_config, EndpointConfigName=config)
    if config_desc is None:
        model = tolerate_missing(sagemaker.describe_model, ModelName=endpoint)
        return Deployment(None, None, (endpoint,) if model else ())
    models = tuple(v["ModelName"] for v in config_desc["ProductionVariants"] if v.get("ModelName"))
    components: dict[str, dict[str, Any]] = {}
    if described:
        for name in _component_names(sagemaker, endpoint):
            spec = sagemaker.describe_inference_component(InferenceComponentName=name).get(
                "Specification", {}
            )
            components[name] = dict(spec)
    variant = dict(config_desc["ProductionVariants"][0]) if config_desc["ProductionVariants"] else {}
    role = config_desc.get("ExecutionRoleArn")
    return Deployment(endpoint if described else None, config, models, components, variant, role)


def _component_names(sagemaker: Any, endpoint: str) -> list[str]:
    names: list[str] = []
    kwargs: dict[str, Any] = {"EndpointNameEquals": endpoint}
    while True:
        page = sagemaker.list_inference_components(**kwargs)
        names += [c["InferenceComponentName"] for c in page.get("InferenceComponents", [])]
        if not page.get("NextToken"):
            return names
        kwargs["NextToken"] = page["NextToken"]


# The variant fields a config sets; a component's endpoint is updated only when one of them changes.
_VARIANT_FIELDS = (
    "InstanceType",
    "InitialInstanceCount",
    "VolumeSizeInGB",
    "ModelDataDownloadTimeoutInSeconds",
    "ContainerStartupHealthCheckTimeoutInSeconds",
)


def variant_changed(current: dict[str, Any], new: dict[str, Any]) -> bool:
    if any(current.get(key) != new.get(key) for key in _VARIANT_FIELDS):
        return True
    scaling = current.get("ManagedInstanceScaling") or {}
    return any(scaling.get(key) != value for key, value in (new.get("ManagedInstanceScaling") or {}).items())


def update_endpoint(
    sagemaker: Any, endpoint: str, config: EndpointConfigSpec, wait: bool = False, max_wait_s: int = 3600
) -> str:
    """Create ``config`` (a new name) and move the endpoint onto it; with ``wait`` until InService."""
    create_endpoint_config(sagemaker, config)
    arn = str(sagemaker.update_endpoint(EndpointName=endpoint, EndpointConfigName=config.name)["EndpointArn"])
    if wait:
        wait_for_endpoint(sagemaker, endpoint, max_wait_s)
    return arn


def update_inference_component(
    sagemaker: Any,
    spec: InferenceComponentSpec,
    wait: bool = False,
    max_wait_s: int = 3600,
    poll_s: float = 30,
) -> str:
    """New model, resources or copy count for an existing component."""
    arn = str(sagemaker.update_inference_component(**spec.update_request())["InferenceComponentArn"])
    if wait:
        wait_for_component(sagemaker, spec.name, max_wait_s, poll_s)
    return arn


def _delete_component(sagemaker: Any, autoscaling: Any, cloudwatch: Any, name: str) -> list[str]:
    resource_id, dimension = component_resource(name)
    removed = []
    target = tolerate_missing(
        autoscaling.deregister_scalable_target,
        ServiceNamespace="sagemaker",
        ResourceId=resource_id,
        ScalableDimension=dimension,
    )
    if target is not None:
        removed.append(f"scalable target {resource_id}")
    alarm = ScaleFromZeroSpec(name).alarm_name
    if cloudwatch.describe_alarms(AlarmNames=[alarm]).get("MetricAlarms"):
        cloudwatch.delete_alarms(AlarmNames=[alarm])
        removed.append(f"alarm {alarm}")
    if tolerate_missing(sagemaker.delete_inference_component, InferenceComponentName=name) is not None:
        removed.append(f"inference component {name}")
    return removed


def _wait_gone(sagemaker: Any, components: list[str], max_wait_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + max_wait_s
    for name in components:
        while tolerate_missing(sagemaker.describe_inference_component, InferenceComponentName=name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"inference component {name} still exists after {max_wait_s} s")
            time.sleep(poll_s)


def delete_deployment(
    sagemaker: Any,
    autoscaling: Any,
    cloudwatch: Any,
    endpoint: str,
    keep_models: bool = False,
    max_wait_s: float = 1800,
    poll_s: float = 15,
) -> list[str]:
    """Delete the endpoint and everything it uses; returns what was deleted, in order."""
    found = describe_deployment(sagemaker, endpoint)
    removed: list[str] = []
    for name in found.components:
        removed += _delete_component(sagemaker, autoscaling, cloudwatch, name)
    _wait_gone(sagemaker, list(found.components), max_wait_s, poll_s)
    if found.endpoint and tolerate_missing(sagemaker.delete_endpoint, EndpointName=endpoint) is not None:
        removed.append(f"endpoint {endpoint}")
    config = found.config
    if config and tolerate_missing(sagemaker.delete_endpoint_config, EndpointConfigName=config) is not None:
        removed.append(f"endpoint config {found.config}")
    models = dict.fromkeys([*found.models, *(spec.get("ModelName") for spec in found.components.values())])
    for model in [] if keep_models else [m for m in models if m]:
        if tolerate_missing(sagemaker.delete_model, ModelName=model) is not None:
            removed.append(f"model {model}")
    return removed

"""SageMaker resources for a neuron-lmi container: model, endpoint config, endpoint, inference
component and target-tracking autoscaling.

Each resource is a frozen spec whose ``request()`` returns the exact keyword arguments of the boto3
call, so the values can be checked without AWS (botocore's ``Stubber`` validates them against the
service's API model). ``create_*`` functions take the boto3 client as an argument: nothing here
creates a session or reads credentials.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

TIMEOUT_RANGE_S = (60, 3600)  # SageMaker's limits for both start-up timeouts
VOLUME_RANGE_GB = (1, 512)
VARIANT_METRIC = "SageMakerVariantInvocationsPerInstance"
COMPONENT_METRIC = "SageMakerInferenceComponentInvocationsPerCopy"


def _check_range(name: str, value: int, bounds: tuple[int, int]) -> None:
    if not bounds[0] <= value <= bounds[1]:
        raise ValueError(f"{name}={value}: must be between {bounds[0]} and {bounds[1]}")


def _check_s3(name: str, uri: str) -> None:
    if not uri.startswith("s3://") or len(uri) <= len("s3://"):
        raise ValueError(f"{name}={uri!r}: expected an s3:// URI")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A SageMaker model: the image plus where its ``/opt/ml/model`` comes from.

    ``model_data`` ending in ``.tar.gz`` is a compressed archive (``ModelDataUrl``); ending in ``/``
    it is an uncompressed S3 prefix (``ModelDataSource`` with ``CompressionType: None``), which
    SageMaker copies file by file — faster to start for large weights, and nothing to unpack.
    """

    name: str
    image_uri: str
    role_arn: str
    model_data: str | None = None
    environment: dict[str, str] = field(default_factory=dict)

    def request(self) -> dict[str, Any]:
        container: dict[str, Any] = {"Image": self.image_uri, "Environment": dict(self.environment)}
        if self.model_data is not None:
            _check_s3("model_data", self.model_data)
            if self.model_data.endswith("/"):
                container["ModelDataSource"] = {
                    "S3DataSource": {
                        "S3Uri": self.model_data,
                        "S3DataType": "S3Prefix",
                        "CompressionType": "None",
                    }
                }
            elif self.model_data.endswith((".tar.gz", ".tgz")):
                container["ModelDataUrl"] = self.model_data
            else:
                raise ValueError(
                    f"model_data={self.model_data!r}: end it with .tar.gz (archive) or / (a prefix)"
                )
        return {"ModelName": self.name, "ExecutionRoleArn": self.role_arn, "PrimaryContainer": container}


@dataclass(frozen=True, slots=True)
class EndpointConfigSpec:
    """One production variant on Inferentia2 by default.

    The start-up timeouts cover downloading the weights and the container's first passing ``/ping``
    (which includes loading, and compiling when no compiled artifacts were shipped). With
    ``inference_components`` the variant names no model; components are placed on it afterwards and
    the config needs an execution role.
    """

    name: str
    model_name: str | None = None
    instance_type: str = "ml.inf2.48xlarge"
    instance_count: int = 1
    variant_name: str = "AllTraffic"
    volume_size_gb: int | None = 256
    model_data_download_timeout_s: int = 1800
    startup_health_check_timeout_s: int = 1800
    inference_components: bool = False
    role_arn: str | None = None
    min_instances: int = 1
    max_instances: int | None = None

    def validate(self) -> None:
        if not self.instance_type.startswith("ml."):
            raise ValueError(f"instance_type={self.instance_type!r}: SageMaker types start with 'ml.'")
        if self.instance_count < 1:
            raise ValueError(f"instance_count={self.instance_count}: must be >= 1")
        _check_range("model_data_download_timeout_s", self.model_data_download_timeout_s, TIMEOUT_RANGE_S)
        _check_range("startup_health_check_timeout_s", self.startup_health_check_timeout_s, TIMEOUT_RANGE_S)
        if self.volume_size_gb is not None:
            _check_range("volume_size_gb", self.volume_size_gb, VOLUME_RANGE_GB)
        if self.inference_components and not self.role_arn:
            raise ValueError("inference_components=True needs role_arn on the endpoint config")
        if not self.inference_components and not self.model_name:
            raise ValueError("model_name is required unless inference_components=True")

    def request(self) -> dict[str, Any]:
        self.validate()
        variant: dict[str, Any] = {
            "VariantName": self.variant_name,
            "InstanceType": self.instance_type,
            "InitialInstanceCount": self.instance_count,
            "ModelDataDownloadTimeoutInSeconds": self.model_data_download_timeout_s,
            "ContainerStartupHealthCheckTimeoutInSeconds": self.startup_health_check_timeout_s,
        }
        if self.volume_size_gb is not None:
            variant["VolumeSizeInGB"] = self.volume_size_gb
        request: dict[str, Any] = {"EndpointConfigName": self.name, "ProductionVariants": [variant]}
        if self.inference_components:
            variant["RoutingConfig"] = {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}
            variant["ManagedInstanceScaling"] = {
                "Status": "ENABLED",
                "MinInstanceCount": self.min_instances,
                "MaxInstanceCount": self.max_instances or max(self.min_instances, self.instance_count),
            }
            request["ExecutionRoleArn"] = self.role_arn
        else:
            variant["ModelName"] = self.model_name
            variant["InitialVariantWeight"] = 1.0
        return request


@dataclass(frozen=True, slots=True)
class InferenceComponentSpec:
    """Copies of one model on an endpoint, each with its own accelerators, memory and CPU."""

    name: str
    endpoint_name: str
    model_name: str
    variant_name: str = "AllTraffic"
    copies: int = 1
    accelerators: int = 1
    min_memory_mb: int = 16384
    cpu_cores: float | None = None
    model_data_download_timeout_s: int = 1800
    startup_health_check_timeout_s: int = 1800

    def request(self) -> dict[str, Any]:
        if self.copies < 1 or self.accelerators < 1:
            raise ValueError(f"copies={self.copies}, accelerators={self.accelerators}: both must be >= 1")
        if self.min_memory_mb < 128:
            raise ValueError(f"min_memory_mb={self.min_memory_mb}: SageMaker's minimum is 128")
        _check_range("model_data_download_timeout_s", self.model_data_download_timeout_s, TIMEOUT_RANGE_S)
        _check_range("startup_health_check_timeout_s", self.startup_health_check_timeout_s, TIMEOUT_RANGE_S)
        resources: dict[str, Any] = {
            "NumberOfAcceleratorDevicesRequired": self.accelerators,
            "MinMemoryRequiredInMb": self.min_memory_mb,
        }
        if self.cpu_cores is not None:
            resources["NumberOfCpuCoresRequired"] = self.cpu_cores
        return {
            "InferenceComponentName": self.name,
            "EndpointName": self.endpoint_name,
            "VariantName": self.variant_name,
            "Specification": {
                "ModelName": self.model_name,
                "ComputeResourceRequirements": resources,
                "StartupParameters": {
                    "ModelDataDownloadTimeoutInSeconds": self.model_data_download_timeout_s,
                    "ContainerStartupHealthCheckTimeoutInSeconds": self.startup_health_check_timeout_s,
                },
            },
            "RuntimeConfig": {"CopyCount": self.copies},
        }


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    """Target tracking on invocations: instances of a variant, or copies of an inference component.

    ``target_invocations`` is invocations per minute per instance (or per copy). Scale-out reacts
    fast; scale-in waits longer because a new Neuron replica takes minutes to load.
    """

    endpoint_name: str
    variant_name: str = "AllTraffic"
    inference_component: str | None = None
    min_capacity: int = 1
    max_capacity: int = 4
    target_invocations: float = 60.0
    scale_out_cooldown_s: int = 60
    scale_in_cooldown_s: int = 600

    def validate(self) -> None:
        if not 0 <= self.min_capacity <= self.max_capacity or self.max_capacity < 1:
            raise ValueError(
                f"capacity {self.min_capacity}..{self.max_capacity}: need 0 <= min <= max, max >= 1"
            )
        if self.target_invocations <= 0:
            raise ValueError(f"target_invocations={self.target_invocations}: must be > 0")

    @property
    def resource_id(self) -> str:
        if self.inference_component:
            return f"inference-component/{self.inference_component}"
        return f"endpoint/{self.endpoint_name}/variant/{self.variant_name}"

    @property
    def dimension(self) -> str:
        if self.inference_component:
            return "sagemaker:inference-component:DesiredCopyCount"
        return "sagemaker:variant:DesiredInstanceCount"

    def target_request(self) -> dict[str, Any]:
        self.validate()
        return {
            "ServiceNamespace": "sagemaker",
            "ResourceId": self.resource_id,
            "ScalableDimension": self.dimension,
            "MinCapacity": self.min_capacity,
            "MaxCapacity": self.max_capacity,
        }

    def policy_request(self) -> dict[str, Any]:
        self.validate()
        metric = COMPONENT_METRIC if self.inference_component else VARIANT_METRIC
        return {
            "PolicyName": f"{self.resource_id.replace('/', '-')}-invocations",
            "ServiceNamespace": "sagemaker",
            "ResourceId": self.resource_id,
            "ScalableDimension": self.dimension,
            "PolicyType": "TargetTrackingScaling",
            "TargetTrackingScalingPolicyConfiguration": {
                "TargetValue": float(self.target_invocations),
                "PredefinedMetricSpecification": {"PredefinedMetricType": metric},
                "ScaleOutCooldown": self.scale_out_cooldown_s,
                "ScaleInCooldown": self.scale_in_cooldown_s,
            },
        }


def create_model(sagemaker: Any, spec: ModelSpec) -> str:
    return str(sagemaker.create_model(**spec.request())["ModelArn"])


def create_endpoint_config(sagemaker: Any, spec: EndpointConfigSpec) -> str:
    return str(sagemaker.create_endpoint_config(**spec.request())["EndpointConfigArn"])


def create_endpoint(
    sagemaker: Any, name: str, config_name: str, wait: bool = False, max_wait_s: int = 3600, poll_s: int = 30
) -> str:
    """Create the endpoint; with ``wait`` block (bounded) until it is InService."""
    arn = str(sagemaker.create_endpoint(EndpointName=name, EndpointConfigName=config_name)["EndpointArn"])
    if wait:
        attempts = max(1, max_wait_s // max(poll_s, 1))
        sagemaker.get_waiter("endpoint_in_service").wait(
            EndpointName=name, WaiterConfig={"Delay": poll_s, "MaxAttempts": attempts}
        )
    return arn


def create_inference_component(
    sagemaker: Any,
    spec: InferenceComponentSpec,
    wait: bool = False,
    max_wait_s: int = 3600,
    poll_s: float = 30,
) -> str:
    """Create the component; with ``wait`` poll (bounded) until InService, raising if it fails."""
    arn = str(sagemaker.create_inference_component(**spec.request())["InferenceComponentArn"])
    deadline = time.monotonic() + max_wait_s
    while wait:
        status = sagemaker.describe_inference_component(InferenceComponentName=spec.name)
        state = status["InferenceComponentStatus"]
        if state == "InService":
            break
        if state == "Failed" or time.monotonic() > deadline:
            reason = status.get("FailureReason", f"not InService after {max_wait_s} s")
            raise RuntimeError(f"inference component {spec.name}: {state}: {reason}")
        time.sleep(poll_s)
    return arn


def enable_autoscaling(autoscaling: Any, spec: AutoscalingSpec) -> str:
    """Register the scalable target and attach the target-tracking policy; returns the policy ARN."""
    autoscaling.register_scalable_target(**spec.target_request())
    return str(autoscaling.put_scaling_policy(**spec.policy_request())["PolicyARN"])

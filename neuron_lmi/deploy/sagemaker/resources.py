"""SageMaker resources for a neuron-lmi container: model, endpoint config, endpoint and inference
component (autoscaling: ``scaling.py``; update and delete: ``lifecycle.py``).

Each resource is a frozen spec whose ``request()`` returns the exact keyword arguments of the boto3
call, so the values can be checked without AWS (botocore's ``Stubber`` validates them against the
service's API model). ``create_*`` functions take the boto3 client as an argument: nothing here
creates a session or reads credentials.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from neuron_lmi.deploy.sagemaker.instances import check_accelerators, check_volume_size, instance_family

TIMEOUT_RANGE_S = (60, 3600)  # SageMaker's limits for both start-up timeouts
VOLUME_RANGE_GB = (1, 512)
SCALE_TO_ZERO_HINT = (
    "a plain production variant cannot scale to zero instances; only an endpoint hosting inference "
    "components can (--inference-components with --autoscale 0:MAX:TARGET)"
)


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
    """One production variant, on Inferentia2 by default.

    The start-up timeouts cover downloading the weights and the container's first passing ``/ping``
    (which includes loading, and compiling when no compiled artifacts were shipped). ``volume_size_gb``
    is left out when None, and refused for families with local NVMe storage (``instances.py``).

    With ``inference_components`` the variant names no model; components are placed on it afterwards,
    the config needs an execution role, and managed instance scaling keeps between ``min_instances``
    (default 1; 0 lets the endpoint scale to zero) and ``max_instances`` instances. A plain variant
    takes neither: its instance count is scaled by Application Auto Scaling, never below one.
    """

    name: str
    model_name: str | None = None
    instance_type: str = "ml.inf2.48xlarge"
    instance_count: int = 1
    variant_name: str = "AllTraffic"
    volume_size_gb: int | None = None
    model_data_download_timeout_s: int = 1800
    startup_health_check_timeout_s: int = 1800
    inference_components: bool = False
    role_arn: str | None = None
    min_instances: int | None = None
    max_instances: int | None = None

    def validate(self) -> None:
        instance_family(self.instance_type)
        if self.instance_count < 1:
            raise ValueError(f"instance_count={self.instance_count}: must be >= 1")
        _check_range("model_data_download_timeout_s", self.model_data_download_timeout_s, TIMEOUT_RANGE_S)
        _check_range("startup_health_check_timeout_s", self.startup_health_check_timeout_s, TIMEOUT_RANGE_S)
        if self.volume_size_gb is not None:
            _check_range("volume_size_gb", self.volume_size_gb, VOLUME_RANGE_GB)
            check_volume_size(self.instance_type, self.volume_size_gb)
        if self.inference_components:
            if not self.role_arn:
                raise ValueError("inference_components=True needs role_arn on the endpoint config")
            low, high = self.instance_range()
            if not 0 <= low <= high or not low <= self.instance_count <= high:
                raise ValueError(
                    f"min_instances={low}, instance_count={self.instance_count}, max_instances={high}: "
                    "need 0 <= min <= count <= max"
                )
            return
        if not self.model_name:
            raise ValueError("model_name is required unless inference_components=True")
        if self.min_instances == 0:
            raise ValueError(f"min_instances=0: {SCALE_TO_ZERO_HINT}")
        if self.min_instances is not None or self.max_instances is not None:
            raise ValueError(
                f"min_instances={self.min_instances}, max_instances={self.max_instances}: managed instance "
                "scaling applies to endpoints hosting inference components; scale a plain variant with "
                "--autoscale MIN:MAX:TARGET"
            )

    def instance_range(self) -> tuple[int, int]:
        """Managed instance scaling's bounds (inference components only)."""
        low = 1 if self.min_instances is None else self.min_instances
        high = self.max_instances if self.max_instances is not None else max(low, self.instance_count)
        return low, high

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
            low, high = self.instance_range()
            variant["RoutingConfig"] = {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}
            variant["ManagedInstanceScaling"] = {
                "Status": "ENABLED",
                "MinInstanceCount": low,
                "MaxInstanceCount": high,
            }
            request["ExecutionRoleArn"] = self.role_arn
        else:
            variant["ModelName"] = self.model_name
            variant["InitialVariantWeight"] = 1.0
        return request


@dataclass(frozen=True, slots=True)
class InferenceComponentSpec:
    """Copies of one model on an endpoint, each with its own accelerators, memory and CPU.

    Given ``instance_type`` and ``tensor_parallel_degree``, ``accelerators`` must be exactly the
    devices one copy's ranks occupy (``instances.check_accelerators``).
    """

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
    instance_type: str | None = None
    tensor_parallel_degree: int | None = None
    logical_nc_config: int | None = None

    def validate(self) -> None:
        if self.copies < 1 or self.accelerators < 1:
            raise ValueError(f"copies={self.copies}, accelerators={self.accelerators}: both must be >= 1")
        if self.min_memory_mb < 128:
            raise ValueError(f"min_memory_mb={self.min_memory_mb}: SageMaker's minimum is 128")
        _check_range("model_data_download_timeout_s", self.model_data_download_timeout_s, TIMEOUT_RANGE_S)
        _check_range("startup_health_check_timeout_s", self.startup_health_check_timeout_s, TIMEOUT_RANGE_S)
        if self.instance_type is not None and self.tensor_parallel_degree is not None:
            check_accelerators(
                self.instance_type, self.tensor_parallel_degree, self.accelerators, self.logical_nc_config
            )

    def specification(self) -> dict[str, Any]:
        """``Specification`` of CreateInferenceComponent and UpdateInferenceComponent."""
        self.validate()
        resources: dict[str, Any] = {
            "NumberOfAcceleratorDevicesRequired": self.accelerators,
            "MinMemoryRequiredInMb": self.min_memory_mb,
        }
        if self.cpu_cores is not None:
            resources["NumberOfCpuCoresRequired"] = self.cpu_cores
        return {
            "ModelName": self.model_name,
            "ComputeResourceRequirements": resources,
            "StartupParameters": {
                "ModelDataDownloadTimeoutInSeconds": self.model_data_download_timeout_s,
                "ContainerStartupHealthCheckTimeoutInSeconds": self.startup_health_check_timeout_s,
            },
        }

    def request(self) -> dict[str, Any]:
        return {
            "InferenceComponentName": self.name,
            "EndpointName": self.endpoint_name,
            "VariantName": self.variant_name,
            "Specification": self.specification(),
            "RuntimeConfig": {"CopyCount": self.copies},
        }

    def update_request(self) -> dict[str, Any]:
        return {
            "InferenceComponentName": self.name,
            "Specification": self.specification(),
            "RuntimeConfig": {"CopyCount": self.copies},
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
        wait_for_endpoint(sagemaker, name, max_wait_s, poll_s)
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
    if wait:
        wait_for_component(sagemaker, spec.name, max_wait_s, poll_s)
    return arn


def wait_for_component(sagemaker: Any, name: str, max_wait_s: int = 3600, poll_s: float = 30) -> None:
    """Poll until the component is InService; RuntimeError when it fails or time runs out."""
    deadline = time.monotonic() + max_wait_s
    while True:
        status = sagemaker.describe_inference_component(InferenceComponentName=name)
        state = status["InferenceComponentStatus"]
        if state == "InService":
            return
        if state == "Failed" or time.monotonic() > deadline:
            reason = status.get("FailureReason", f"not InService after {max_wait_s} s")
            raise RuntimeError(f"inference component {name}: {state}: {reason}")
        time.sleep(poll_s)


def wait_for_endpoint(sagemaker: Any, name: str, max_wait_s: int = 3600, poll_s: int = 30) -> None:
    attempts = max(1, max_wait_s // max(poll_s, 1))
    sagemaker.get_waiter("endpoint_in_service").wait(
        EndpointName=name, WaiterConfig={"Delay": poll_s, "MaxAttempts": attempts}
    )

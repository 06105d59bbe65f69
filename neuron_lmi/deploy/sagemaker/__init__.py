"""SageMaker deployment for neuron-lmi on boto3: upload, model/endpoint/component, autoscaling,
update, delete, invoke.

Run ``neuron-lmi deploy --help``. The functions take boto3 clients as arguments, so tests drive them
with botocore's ``Stubber`` and a local S3-compatible server.
"""

from neuron_lmi.deploy.sagemaker.instances import accepts_volume_size, check_accelerators, devices_needed
from neuron_lmi.deploy.sagemaker.invoke import (
    EndpointError,
    Generation,
    JsonLinesDecoder,
    generate,
    iter_stream_objects,
)
from neuron_lmi.deploy.sagemaker.resources import (
    EndpointConfigSpec,
    InferenceComponentSpec,
    ModelSpec,
    create_endpoint,
    create_endpoint_config,
    create_inference_component,
    create_model,
)
from neuron_lmi.deploy.sagemaker.scaling import (
    AutoscalingSpec,
    ScaleFromZeroSpec,
    enable_autoscaling,
    enable_scale_from_zero,
)
from neuron_lmi.deploy.sagemaker.storage import split_s3_uri, upload_archive, upload_directory

__all__ = [
    "AutoscalingSpec",
    "EndpointConfigSpec",
    "EndpointError",
    "Generation",
    "InferenceComponentSpec",
    "JsonLinesDecoder",
    "ModelSpec",
    "ScaleFromZeroSpec",
    "accepts_volume_size",
    "check_accelerators",
    "create_endpoint",
    "create_endpoint_config",
    "create_inference_component",
    "create_model",
    "devices_needed",
    "enable_autoscaling",
    "enable_scale_from_zero",
    "generate",
    "iter_stream_objects",
    "split_s3_uri",
    "upload_archive",
    "upload_directory",
]

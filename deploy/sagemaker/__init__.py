"""SageMaker deployment for neuron-lmi on boto3: upload, model/endpoint/component, autoscaling, invoke.

Run ``python -m deploy.sagemaker --help``. The functions take boto3 clients as arguments, so tests
drive them with botocore's ``Stubber`` and a local S3-compatible server.
"""

from deploy.sagemaker.invoke import EndpointError, Generation, JsonLinesDecoder, generate, iter_stream_objects
from deploy.sagemaker.resources import (
    AutoscalingSpec,
    EndpointConfigSpec,
    InferenceComponentSpec,
    ModelSpec,
    create_endpoint,
    create_endpoint_config,
    create_inference_component,
    create_model,
    enable_autoscaling,
)
from deploy.sagemaker.storage import split_s3_uri, upload_archive, upload_directory

__all__ = [
    "AutoscalingSpec",
    "EndpointConfigSpec",
    "EndpointError",
    "Generation",
    "InferenceComponentSpec",
    "JsonLinesDecoder",
    "ModelSpec",
    "create_endpoint",
    "create_endpoint_config",
    "create_inference_component",
    "create_model",
    "enable_autoscaling",
    "generate",
    "iter_stream_objects",
    "split_s3_uri",
    "upload_archive",
    "upload_directory",
]

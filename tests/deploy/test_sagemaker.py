"""SageMaker resources and the deploy CLI: every boto3 call checked by botocore's Stubber against
AWS's own API model (S3 uploads: test_sagemaker_s3.py; invoke and streams: test_sagemaker_invoke.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from deploy.sagemaker import (
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
from deploy.sagemaker.__main__ import build_parser

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/neuron-lmi:neuron"
CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": REGION}


def arn(kind: str, name: str) -> str:
    return f"arn:aws:sagemaker:{REGION}:123456789012:{kind}/{name}"


def client(service: str, **kwargs: Any) -> Any:
    return boto3.client(service, **CREDS, **kwargs)


@pytest.fixture()
def sagemaker() -> Iterator[tuple[Any, Stubber]]:
    sm = client("sagemaker")
    with Stubber(sm) as stub:
        yield sm, stub
        stub.assert_no_pending_responses()


def test_model_from_uncompressed_prefix_and_archive(sagemaker) -> None:
    sm, stub = sagemaker
    env = {"OPTION_TENSOR_PARALLEL_DEGREE": "8", "OPTION_MAX_ROLLING_BATCH_SIZE": "16"}
    prefix = ModelSpec("mistral", IMAGE, ROLE, "s3://bucket/mistral/", env)
    expected = prefix.request()
    source = expected["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]
    assert source == {"S3Uri": "s3://bucket/mistral/", "S3DataType": "S3Prefix", "CompressionType": "None"}
    assert "ModelDataUrl" not in expected["PrimaryContainer"]
    stub.add_response("create_model", {"ModelArn": arn("model", "mistral")}, expected)
    assert create_model(sm, prefix) == arn("model", "mistral")

    archive = ModelSpec("mistral-tgz", IMAGE, ROLE, "s3://bucket/model.tar.gz")
    assert archive.request()["PrimaryContainer"]["ModelDataUrl"] == "s3://bucket/model.tar.gz"
    stub.add_response("create_model", {"ModelArn": arn("model", "mistral-tgz")}, archive.request())
    create_model(sm, archive)
    with pytest.raises(ValueError, match="model_data"):
        ModelSpec("x", IMAGE, ROLE, "s3://bucket/weights.bin").request()


def test_endpoint_config_on_inf2_with_timeouts(sagemaker) -> None:
    sm, stub = sagemaker
    spec = EndpointConfigSpec("mistral", "mistral", startup_health_check_timeout_s=2400, volume_size_gb=128)
    request = spec.request()
    (variant,) = request["ProductionVariants"]
    assert variant["InstanceType"] == "ml.inf2.48xlarge"
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 2400
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 1800
    assert variant["VolumeSizeInGB"] == 128 and variant["ModelName"] == "mistral"
    stub.add_response(
        "create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "mistral")}, request
    )
    assert create_endpoint_config(sm, spec) == arn("endpoint-config", "mistral")

    stub.add_response(
        "create_endpoint",
        {"EndpointArn": arn("endpoint", "mistral")},
        {"EndpointName": "mistral", "EndpointConfigName": "mistral"},
    )
    stub.add_response("describe_endpoint", _described("Creating"), {"EndpointName": "mistral"})
    stub.add_response("describe_endpoint", _described("InService"), {"EndpointName": "mistral"})
    assert create_endpoint(sm, "mistral", "mistral", wait=True, max_wait_s=60, poll_s=0) == arn(
        "endpoint", "mistral"
    )


def _described(status: str) -> dict[str, Any]:
    return {
        "EndpointName": "mistral",
        "EndpointArn": arn("endpoint", "mistral"),
        "EndpointStatus": status,
        "CreationTime": "2026-01-01T00:00:00Z",
        "LastModifiedTime": "2026-01-01T00:00:00Z",
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"startup_health_check_timeout_s": 30}, "startup_health_check_timeout_s"),
        ({"model_data_download_timeout_s": 7200}, "model_data_download_timeout_s"),
        ({"volume_size_gb": 1024}, "volume_size_gb"),
        ({"instance_type": "inf2.48xlarge"}, "ml."),
        ({"inference_components": True}, "role_arn"),
    ],
)
def test_endpoint_config_rejects_bad_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EndpointConfigSpec("c", "m", **kwargs).request()


def test_inference_components_and_their_autoscaling(sagemaker, monkeypatch) -> None:
    sm, stub = sagemaker
    config = EndpointConfigSpec(
        "ep", instance_type="ml.inf2.24xlarge", inference_components=True, role_arn=ROLE
    )
    request = config.request()
    assert "ModelName" not in request["ProductionVariants"][0] and request["ExecutionRoleArn"] == ROLE
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "ep")}, request)
    create_endpoint_config(sm, config)

    component = InferenceComponentSpec(
        "llama-ic", "ep", "llama", copies=2, accelerators=4, min_memory_mb=32768
    )
    ic_request = component.request()
    assert ic_request["RuntimeConfig"] == {"CopyCount": 2}
    assert ic_request["Specification"]["ComputeResourceRequirements"] == {
        "NumberOfAcceleratorDevicesRequired": 4,
        "MinMemoryRequiredInMb": 32768,
    }
    stub.add_response(
        "create_inference_component",
        {"InferenceComponentArn": arn("inference-component", "llama")},
        ic_request,
    )
    described = {
        "InferenceComponentName": "llama-ic",
        "InferenceComponentArn": arn("inference-component", "llama"),
        "EndpointName": "ep",
        "EndpointArn": arn("endpoint", "ep"),
        "CreationTime": "2026-01-01T00:00:00Z",
        "LastModifiedTime": "2026-01-01T00:00:00Z",
    }
    for state in ("Creating", "InService"):
        stub.add_response(
            "describe_inference_component",
            {**described, "InferenceComponentStatus": state},
            {"InferenceComponentName": "llama-ic"},
        )
    monkeypatch.setattr("deploy.sagemaker.resources.time.sleep", lambda _s: None)
    assert create_inference_component(sm, component, wait=True, max_wait_s=60) == arn(
        "inference-component", "llama"
    )

    aas = client("application-autoscaling")
    scaling = AutoscalingSpec("ep", inference_component="llama-ic", min_capacity=1, max_capacity=6)
    with Stubber(aas) as aas_stub:
        target = scaling.target_request()
        assert target["ScalableDimension"] == "sagemaker:inference-component:DesiredCopyCount"
        aas_stub.add_response("register_scalable_target", {}, target)
        policy = scaling.policy_request()
        metric = policy["TargetTrackingScalingPolicyConfiguration"]["PredefinedMetricSpecification"]
        assert metric == {"PredefinedMetricType": "SageMakerInferenceComponentInvocationsPerCopy"}
        aas_stub.add_response("put_scaling_policy", {"PolicyARN": arn("policy", "ic"), "Alarms": []}, policy)
        assert enable_autoscaling(aas, scaling) == arn("policy", "ic")
        aas_stub.assert_no_pending_responses()


def test_variant_target_tracking_policy() -> None:
    aas = client("application-autoscaling")
    scaling = AutoscalingSpec("ep", min_capacity=1, max_capacity=4, target_invocations=120)
    with Stubber(aas) as stub:
        stub.add_response(
            "register_scalable_target",
            {},
            {
                "ServiceNamespace": "sagemaker",
                "ResourceId": "endpoint/ep/variant/AllTraffic",
                "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
                "MinCapacity": 1,
                "MaxCapacity": 4,
            },
        )
        policy = scaling.policy_request()
        tracking = policy["TargetTrackingScalingPolicyConfiguration"]
        assert policy["PolicyType"] == "TargetTrackingScaling"
        assert tracking["TargetValue"] == 120.0
        assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == (
            "SageMakerVariantInvocationsPerInstance"
        )
        assert tracking["ScaleInCooldown"] > tracking["ScaleOutCooldown"]
        stub.add_response("put_scaling_policy", {"PolicyARN": arn("policy", "variant"), "Alarms": []}, policy)
        enable_autoscaling(aas, scaling)
        stub.assert_no_pending_responses()
    with pytest.raises(ValueError, match="capacity"):
        AutoscalingSpec("ep", min_capacity=5, max_capacity=2).target_request()


def test_cli_parses_a_full_deploy() -> None:
    args = build_parser().parse_args(
        [
            "deploy",
            "--name",
            "m",
            "--image",
            IMAGE,
            "--role",
            ROLE,
            "--model-data",
            "s3://b/m/",
            "--instance-type",
            "ml.inf2.24xlarge",
            "--autoscale",
            "1:4:90",
            "--inference-components",
        ]
    )
    assert args.autoscale == (1, 4, 90.0) and args.instance_type == "ml.inf2.24xlarge"
    assert args.startup_timeout == 1800 and args.inference_components


def test_cli_deploy_makes_the_calls_in_order(monkeypatch) -> None:
    sm, aas = client("sagemaker"), client("application-autoscaling")
    monkeypatch.setattr(
        "deploy.sagemaker.__main__._client", lambda _a, service, **_k: {"sagemaker": sm}.get(service, aas)
    )
    argv = [
        "deploy",
        "--name",
        "m",
        "--image",
        IMAGE,
        "--role",
        ROLE,
        "--model-data",
        "s3://b/m/model.tar.gz",
    ]
    argv += ["--env", "OPTION_TENSOR_PARALLEL_DEGREE=2", "--instance-type", "ml.inf2.xlarge"]
    args = build_parser().parse_args([*argv, "--autoscale", "1:3:50"])
    with Stubber(sm) as sm_stub, Stubber(aas) as aas_stub:
        model = ModelSpec("m", IMAGE, ROLE, "s3://b/m/model.tar.gz", {"OPTION_TENSOR_PARALLEL_DEGREE": "2"})
        sm_stub.add_response("create_model", {"ModelArn": arn("model", "m")}, model.request())
        config = EndpointConfigSpec("m", "m", instance_type="ml.inf2.xlarge")
        sm_stub.add_response(
            "create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "m")}, config.request()
        )
        sm_stub.add_response(
            "create_endpoint",
            {"EndpointArn": arn("endpoint", "m")},
            {"EndpointName": "m", "EndpointConfigName": "m"},
        )
        sm_stub.add_response(
            "describe_endpoint", {**_described("InService"), "EndpointName": "m"}, {"EndpointName": "m"}
        )
        scaling = AutoscalingSpec("m", min_capacity=1, max_capacity=3, target_invocations=50)
        aas_stub.add_response("register_scalable_target", {}, scaling.target_request())
        aas_stub.add_response(
            "put_scaling_policy", {"PolicyARN": arn("policy", "m"), "Alarms": []}, scaling.policy_request()
        )
        assert args.func(args) == 0
        sm_stub.assert_no_pending_responses()
        aas_stub.assert_no_pending_responses()

"""SageMaker resources, instance-family rules and autoscaling: every boto3 call checked by botocore's
Stubber against AWS's own API model (CLI flows, update and delete: test_sagemaker_lifecycle.py;
S3 uploads: test_sagemaker_s3.py; invoke and streams: test_sagemaker_invoke.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.session
import pytest
from botocore.stub import Stubber

from neuron_lmi.deploy.sagemaker import (
    AutoscalingSpec,
    EndpointConfigSpec,
    InferenceComponentSpec,
    ModelSpec,
    ScaleFromZeroSpec,
    accepts_volume_size,
    check_accelerators,
    create_endpoint,
    create_endpoint_config,
    create_inference_component,
    create_model,
    devices_needed,
    enable_autoscaling,
    enable_scale_from_zero,
)
from neuron_lmi.deploy.sagemaker.scaling import METRICS

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
    assert "ManagedInstanceScaling" not in variant
    stub.add_response(
        "create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "mistral")}, request
    )
    assert create_endpoint_config(sm, spec) == arn("endpoint-config", "mistral")

    stub.add_response(
        "create_endpoint",
        {"EndpointArn": arn("endpoint", "mistral")},
        {"EndpointName": "mistral", "EndpointConfigName": "mistral"},
    )
    stub.add_response("describe_endpoint", described("Creating"), {"EndpointName": "mistral"})
    stub.add_response("describe_endpoint", described("InService"), {"EndpointName": "mistral"})
    assert create_endpoint(sm, "mistral", "mistral", wait=True, max_wait_s=60, poll_s=0) == arn(
        "endpoint", "mistral"
    )


def described(status: str, name: str = "mistral") -> dict[str, Any]:
    return {
        "EndpointName": name,
        "EndpointArn": arn("endpoint", name),
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
        ({"min_instances": 0}, "plain production variant cannot scale to zero"),
        ({"min_instances": 1, "max_instances": 3}, "inference components"),
        ({"inference_components": True, "role_arn": ROLE, "min_instances": 2, "max_instances": 1}, "min <="),
    ],
)
def test_endpoint_config_rejects_bad_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EndpointConfigSpec("c", "m", **kwargs).request()


@pytest.mark.parametrize(
    ("instance_type", "accepts"),
    [
        ("ml.inf2.24xlarge", True),
        ("ml.inf2.xlarge", True),
        ("ml.m5.xlarge", True),
        ("ml.c5.2xlarge", True),
        ("ml.g5.12xlarge", False),
        ("ml.g6e.xlarge", False),
        ("ml.trn1.32xlarge", False),
        ("ml.trn1n.32xlarge", False),
        ("ml.g4dn.xlarge", False),
        ("ml.p4d.24xlarge", False),
        ("ml.p4de.24xlarge", False),
        ("ml.p3dn.24xlarge", False),
        ("ml.m5d.large", False),
        ("ml.c6id.large", False),
    ],
)
def test_volume_size_only_where_the_family_accepts_it(instance_type: str, accepts: bool) -> None:
    assert accepts_volume_size(instance_type) is accepts
    spec = EndpointConfigSpec("c", "m", instance_type=instance_type, volume_size_gb=256)
    if accepts:
        assert spec.request()["ProductionVariants"][0]["VolumeSizeInGB"] == 256
    else:
        with pytest.raises(ValueError, match="local NVMe"):
            spec.request()
        bare = EndpointConfigSpec("c", "m", instance_type=instance_type).request()
        assert "VolumeSizeInGB" not in bare["ProductionVariants"][0]


@pytest.mark.parametrize(
    ("instance_type", "tp", "devices"),
    [
        ("ml.inf2.xlarge", 2, 1),  # 2 NeuronCores per Inferentia2 device
        ("ml.inf2.24xlarge", 8, 4),
        ("ml.inf2.48xlarge", 24, 12),
        ("ml.trn1.32xlarge", 32, 16),
        ("ml.trn2.48xlarge", 64, 16),  # 8 NeuronCore-v3 per device, pairs at LNC=2
        ("ml.g5.12xlarge", 4, 4),  # one GPU per rank
        ("ml.p4d.24xlarge", 8, 8),
        ("ml.m5.xlarge", 1, None),  # no accelerator: nothing to count
    ],
)
def test_devices_per_copy_follow_the_tensor_parallel_degree(instance_type: str, tp: int, devices) -> None:
    assert devices_needed(instance_type, tp) == devices
    check_accelerators(instance_type, tp, devices)


@pytest.mark.parametrize(
    ("instance_type", "tp", "accelerators", "match"),
    [
        ("ml.inf2.48xlarge", 8, 8, "needs 4 .*leave 4 idle"),  # counted cores, not devices
        ("ml.inf2.48xlarge", 8, 2, "cannot hold the ranks"),
        ("ml.g5.12xlarge", 4, 1, "needs 4 GPUs"),
        ("ml.inf2.xlarge", 8, None, "ml.inf2.xlarge has 1"),
        ("ml.inf2.24xlarge", 24, None, "has 6"),
    ],
)
def test_accelerators_that_do_not_fit_the_degree_are_refused(instance_type, tp, accelerators, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_accelerators(instance_type, tp, accelerators)
    spec = InferenceComponentSpec(
        "ic",
        "ep",
        "m",
        accelerators=accelerators or 1,
        instance_type=instance_type,
        tensor_parallel_degree=tp,
    )
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        spec.request()


def test_inference_components_and_their_autoscaling(sagemaker, monkeypatch) -> None:
    sm, stub = sagemaker
    config = EndpointConfigSpec(
        "ep",
        instance_type="ml.inf2.24xlarge",
        inference_components=True,
        role_arn=ROLE,
        min_instances=1,
        max_instances=3,
    )
    request = config.request()
    (variant,) = request["ProductionVariants"]
    assert "ModelName" not in variant and request["ExecutionRoleArn"] == ROLE
    assert variant["ManagedInstanceScaling"] == {
        "Status": "ENABLED",
        "MinInstanceCount": 1,
        "MaxInstanceCount": 3,
    }
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "ep")}, request)
    create_endpoint_config(sm, config)

    component = InferenceComponentSpec(
        "llama-ic",
        "ep",
        "llama",
        copies=2,
        accelerators=4,
        min_memory_mb=32768,
        instance_type="ml.inf2.24xlarge",
        tensor_parallel_degree=8,
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
    for state in ("Creating", "InService"):
        stub.add_response(
            "describe_inference_component",
            {**described_component("llama-ic", "ep"), "InferenceComponentStatus": state},
            {"InferenceComponentName": "llama-ic"},
        )
    monkeypatch.setattr("neuron_lmi.deploy.sagemaker.resources.time.sleep", lambda _s: None)
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


def described_component(name: str, endpoint: str, model: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "InferenceComponentName": name,
        "InferenceComponentArn": arn("inference-component", name),
        "EndpointName": endpoint,
        "EndpointArn": arn("endpoint", endpoint),
        "CreationTime": "2026-01-01T00:00:00Z",
        "LastModifiedTime": "2026-01-01T00:00:00Z",
    }
    if model is not None:
        out["Specification"] = {"ModelName": model}
    return out


def test_variant_target_tracking_policy() -> None:
    aas = client("application-autoscaling")
    scaling = AutoscalingSpec("ep", min_capacity=1, max_capacity=4, target_value=120)
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
    with pytest.raises(ValueError, match="plain production variant cannot scale to zero"):
        AutoscalingSpec("ep", min_capacity=0, max_capacity=2).target_request()


@pytest.mark.parametrize("component", [None, "ic"])
def test_concurrency_metrics_are_aws_predefined_types(component: str | None) -> None:
    """The four metric names are members of Application Auto Scaling's MetricType enum (Stubber
    checks types and required fields but not enum values, so the model is read here)."""
    model = botocore.session.get_session().get_service_model("application-autoscaling")
    assert set(METRICS.values()) <= set(model.shape_for("MetricType").enum)
    scaling = AutoscalingSpec("ep", inference_component=component, target_value=4, metric="concurrency")
    policy = scaling.policy_request()
    metric = policy["TargetTrackingScalingPolicyConfiguration"]["PredefinedMetricSpecification"]
    expected = (
        "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution"
        if component
        else "SageMakerVariantConcurrentRequestsPerModelHighResolution"
    )
    assert metric["PredefinedMetricType"] == expected
    aas = client("application-autoscaling")
    with Stubber(aas) as stub:
        stub.add_response("register_scalable_target", {}, scaling.target_request())
        stub.add_response("put_scaling_policy", {"PolicyARN": arn("policy", "c"), "Alarms": []}, policy)
        enable_autoscaling(aas, scaling)
        stub.assert_no_pending_responses()
    with pytest.raises(ValueError, match="metric"):
        AutoscalingSpec("ep", metric="latency").policy_request()


def test_scale_from_zero_step_policy_and_no_capacity_alarm() -> None:
    aas, cloudwatch = client("application-autoscaling"), client("cloudwatch")
    spec = ScaleFromZeroSpec("llama-ic")
    policy = spec.policy_request()
    assert policy["ResourceId"] == "inference-component/llama-ic"
    assert policy["ScalableDimension"] == "sagemaker:inference-component:DesiredCopyCount"
    assert policy["PolicyType"] == "StepScaling"
    step = policy["StepScalingPolicyConfiguration"]
    assert step["AdjustmentType"] == "ChangeInCapacity"
    assert step["StepAdjustments"] == [{"MetricIntervalLowerBound": 0.0, "ScalingAdjustment": 1}]
    policy_arn = "arn:aws:autoscaling:us-east-1:123456789012:scalingPolicy:x:resource/sagemaker/from-zero"
    alarm = spec.alarm_request(policy_arn)
    assert alarm["MetricName"] == "NoCapacityInvocationFailures" and alarm["Namespace"] == "AWS/SageMaker"
    assert alarm["Dimensions"] == [{"Name": "InferenceComponentName", "Value": "llama-ic"}]
    assert alarm["AlarmActions"] == [policy_arn]
    assert alarm["Threshold"] == 1.0 and alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    with Stubber(aas) as aas_stub, Stubber(cloudwatch) as cw_stub:
        aas_stub.add_response("put_scaling_policy", {"PolicyARN": policy_arn, "Alarms": []}, policy)
        cw_stub.add_response("put_metric_alarm", {}, alarm)
        assert enable_scale_from_zero(aas, cloudwatch, spec) == "llama-ic-no-capacity"
        aas_stub.assert_no_pending_responses()
        cw_stub.assert_no_pending_responses()


def test_deploy_ships_in_the_package_outside_a_checkout(tmp_path: Path) -> None:
    """``neuron-lmi deploy`` runs from any directory; the repository's ``deploy/`` is not importable
    there, so nothing depends on a checkout."""
    script = (
        "import importlib.util, sys\n"
        "from neuron_lmi.cli import build_parser\n"
        "assert importlib.util.find_spec('deploy') is None, 'deploy/ reachable'\n"
        "build_parser().parse_args(sys.argv[1:])\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script, "deploy", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for action in ("upload", "create", "update", "delete", "autoscale", "invoke-stream"):
        assert action in result.stdout

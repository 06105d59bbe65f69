"""``neuron-lmi deploy create|update|delete`` end to end through the packaged command line: every
SageMaker, Application Auto Scaling and CloudWatch call, in order, checked by botocore's Stubber
against AWS's API model. A refused flag makes no call at all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from neuron_lmi.cli import main

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/neuron-lmi:neuron"
CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": REGION}
T0 = "2026-01-01T00:00:00Z"
POLICY = "arn:aws:autoscaling:us-east-1:123456789012:scalingPolicy:1:resource/sagemaker/p"
TIMEOUTS = {"ModelDataDownloadTimeoutInSeconds": 1800, "ContainerStartupHealthCheckTimeoutInSeconds": 1800}
ROUTING = {"RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}
CREATE = ["deploy", "create", "--name", "m", "--image", IMAGE, "--role", ROLE, "--model-data", "s3://b/m/"]
VARIANT_TARGET = ("endpoint/m/variant/AllTraffic", "sagemaker:variant:DesiredInstanceCount")


def arn(kind: str, name: str) -> str:
    return f"arn:aws:sagemaker:{REGION}:123456789012:{kind}/{name}"


@pytest.fixture()
def aws(monkeypatch) -> Iterator[dict[str, Stubber]]:
    """Stubbed clients behind ``neuron-lmi deploy``; each must have consumed every queued response."""
    names = ("sagemaker", "application-autoscaling", "cloudwatch")
    clients = {name: boto3.client(name, **CREDS) for name in names}
    monkeypatch.setattr("neuron_lmi.deploy.sagemaker.commands.client", lambda _a, svc, **_k: clients[svc])
    monkeypatch.setattr("neuron_lmi.deploy.sagemaker.resources.time.sleep", lambda _s: None)
    monkeypatch.setattr("neuron_lmi.deploy.sagemaker.lifecycle.time.sleep", lambda _s: None)
    stubs = {name: Stubber(c) for name, c in clients.items()}
    for stub in stubs.values():
        stub.activate()
    yield stubs
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()


# --- requests and responses ----------------------------------------------------------------------


def model_request(name: str, data: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    source = {"S3DataSource": {"S3Uri": data, "S3DataType": "S3Prefix", "CompressionType": "None"}}
    container = {"Image": IMAGE, "Environment": env or {}, "ModelDataSource": source}
    return {"ModelName": name, "ExecutionRoleArn": ROLE, "PrimaryContainer": container}


def variant(instance: str, **extra: Any) -> dict[str, Any]:
    base = {"VariantName": "AllTraffic", "InstanceType": instance, "InitialInstanceCount": 1, **TIMEOUTS}
    return {**base, **extra}


def managed(low: int, high: int) -> dict[str, Any]:
    return {
        "ManagedInstanceScaling": {"Status": "ENABLED", "MinInstanceCount": low, "MaxInstanceCount": high}
    }


def plain(model: str) -> dict[str, Any]:
    return {"ModelName": model, "InitialVariantWeight": 1.0}


def specification(model: str, devices: int) -> dict[str, Any]:
    resources = {"NumberOfAcceleratorDevicesRequired": devices, "MinMemoryRequiredInMb": 16384}
    return {"ModelName": model, "ComputeResourceRequirements": resources, "StartupParameters": TIMEOUTS}


def target(resource_id: str, dimension: str) -> dict[str, str]:
    return {"ServiceNamespace": "sagemaker", "ResourceId": resource_id, "ScalableDimension": dimension}


def endpoint(name: str, config: str) -> dict[str, Any]:
    return {
        "EndpointName": name,
        "EndpointArn": arn("endpoint", name),
        "EndpointConfigName": config,
        "EndpointStatus": "InService",
        "CreationTime": T0,
        "LastModifiedTime": T0,
    }


def component(name: str, model: str | None = None, status: str = "InService") -> dict[str, Any]:
    out: dict[str, Any] = {
        "InferenceComponentName": name,
        "InferenceComponentArn": arn("inference-component", name),
        "EndpointName": name,
        "EndpointArn": arn("endpoint", name),
        "CreationTime": T0,
        "LastModifiedTime": T0,
        "InferenceComponentStatus": status,
    }
    if model:
        out["Specification"] = {"ModelName": model}
    return out


def config(name: str, described_variant: dict[str, Any]) -> dict[str, Any]:
    return {
        "EndpointConfigName": name,
        "EndpointConfigArn": arn("endpoint-config", name),
        "ProductionVariants": [{"VariantName": "AllTraffic", **described_variant}],
        "CreationTime": T0,
    }


def listed(ep: str, *names: str) -> dict[str, Any]:
    summaries = [
        {
            "InferenceComponentName": n,
            "InferenceComponentArn": arn("inference-component", n),
            "EndpointName": ep,
            "EndpointArn": arn("endpoint", ep),
            "VariantName": "AllTraffic",
            "CreationTime": T0,
            "LastModifiedTime": T0,
        }
        for n in names
    ]
    return {"InferenceComponents": summaries}


def not_found(stub: Stubber, method: str, params: dict[str, Any], what: str) -> None:
    stub.add_client_error(
        method, "ValidationException", f"Could not find {what}.", 400, expected_params=params
    )


def expect_create(
    sm: Stubber, model: dict[str, Any], endpoint_variant: dict[str, Any], components: bool
) -> None:
    """CreateModel, CreateEndpointConfig, CreateEndpoint and the wait for InService."""
    sm.add_response("create_model", {"ModelArn": arn("model", "m")}, model)
    request: dict[str, Any] = {"EndpointConfigName": "m", "ProductionVariants": [endpoint_variant]}
    if components:
        request["ExecutionRoleArn"] = ROLE
    sm.add_response("create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "m")}, request)
    sm.add_response(
        "create_endpoint",
        {"EndpointArn": arn("endpoint", "m")},
        {"EndpointName": "m", "EndpointConfigName": "m"},
    )
    sm.add_response("describe_endpoint", endpoint("m", "m"), {"EndpointName": "m"})


def expect_component(sm: Stubber, devices: int) -> None:
    request = {
        "InferenceComponentName": "m",
        "EndpointName": "m",
        "VariantName": "AllTraffic",
        "Specification": specification("m", devices),
        "RuntimeConfig": {"CopyCount": 1},
    }
    sm.add_response(
        "create_inference_component", {"InferenceComponentArn": arn("inference-component", "m")}, request
    )


def expect_tracking(aas: Stubber, resource: dict[str, str], name: str, metric: str, value: float) -> None:
    tracking = {
        "TargetValue": value,
        "ScaleOutCooldown": 60,
        "ScaleInCooldown": 600,
        "PredefinedMetricSpecification": {"PredefinedMetricType": metric},
    }
    aas.add_response(
        "put_scaling_policy",
        {"PolicyARN": POLICY, "Alarms": []},
        {
            **resource,
            "PolicyName": name,
            "PolicyType": "TargetTrackingScaling",
            "TargetTrackingScalingPolicyConfiguration": tracking,
        },
    )


# --- create --------------------------------------------------------------------------------------


def test_plain_endpoint_on_inf2_with_volume_and_invocation_scaling(aws) -> None:
    sm, aas = aws["sagemaker"], aws["application-autoscaling"]
    model = model_request("m", "s3://b/m/", {"OPTION_TENSOR_PARALLEL_DEGREE": "2"})
    expect_create(sm, model, variant("ml.inf2.xlarge", VolumeSizeInGB=256, **plain("m")), components=False)
    resource = target(*VARIANT_TARGET)
    aas.add_response("register_scalable_target", {}, {**resource, "MinCapacity": 1, "MaxCapacity": 3})
    metric = "SageMakerVariantInvocationsPerInstance"
    expect_tracking(aas, resource, "endpoint-m-variant-AllTraffic-invocations", metric, 50.0)
    argv = [*CREATE, "--env", "OPTION_TENSOR_PARALLEL_DEGREE=2", "--instance-type", "ml.inf2.xlarge"]
    assert main([*argv, "--autoscale", "1:3:50"]) == 0


def test_components_on_g5_leave_the_volume_out_and_get_one_gpu_per_rank(aws) -> None:
    sm = aws["sagemaker"]
    model = model_request("m", "s3://b/m/", {"OPTION_TENSOR_PARALLEL_DEGREE": "4"})
    expect_create(sm, model, variant("ml.g5.12xlarge", **ROUTING, **managed(1, 2)), components=True)
    expect_component(sm, devices=4)
    argv = [*CREATE, "--env", "OPTION_TENSOR_PARALLEL_DEGREE=4", "--instance-type", "ml.g5.12xlarge"]
    assert main([*argv, "--inference-components", "--min-instances", "1", "--max-instances", "2"]) == 0


def test_components_scale_to_zero_with_a_no_capacity_alarm(aws) -> None:
    sm, aas, cloudwatch = aws["sagemaker"], aws["application-autoscaling"], aws["cloudwatch"]
    endpoint_variant = variant("ml.inf2.xlarge", VolumeSizeInGB=256, **ROUTING, **managed(0, 1))
    expect_create(sm, model_request("m", "s3://b/m/"), endpoint_variant, components=True)
    expect_component(sm, devices=1)  # tensor parallel degree 2 = one Inferentia2 device
    sm.add_response("describe_inference_component", component("m"), {"InferenceComponentName": "m"})
    resource = target("inference-component/m", "sagemaker:inference-component:DesiredCopyCount")
    aas.add_response("register_scalable_target", {}, {**resource, "MinCapacity": 0, "MaxCapacity": 2})
    metric = "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution"
    expect_tracking(aas, resource, "inference-component-m-concurrency", metric, 4.0)
    step = {
        "AdjustmentType": "ChangeInCapacity",
        "MetricAggregationType": "Maximum",
        "Cooldown": 60,
        "StepAdjustments": [{"MetricIntervalLowerBound": 0.0, "ScalingAdjustment": 1}],
    }
    aas.add_response(
        "put_scaling_policy",
        {"PolicyARN": POLICY + "0", "Alarms": []},
        {
            **resource,
            "PolicyName": "inference-component-m-from-zero",
            "PolicyType": "StepScaling",
            "StepScalingPolicyConfiguration": step,
        },
    )
    alarm = {
        "AlarmName": "m-no-capacity",
        "AlarmDescription": "m was invoked with no copy: add 1",
        "AlarmActions": [POLICY + "0"],
        "MetricName": "NoCapacityInvocationFailures",
        "Namespace": "AWS/SageMaker",
        "Statistic": "Sum",
        "Dimensions": [{"Name": "InferenceComponentName", "Value": "m"}],
        "Period": 60,
        "EvaluationPeriods": 1,
        "DatapointsToAlarm": 1,
        "Threshold": 1.0,
        "ComparisonOperator": "GreaterThanOrEqualToThreshold",
        "TreatMissingData": "missing",
    }
    cloudwatch.add_response("put_metric_alarm", {}, alarm)
    argv = [
        *CREATE,
        "--instance-type",
        "ml.inf2.xlarge",
        "--tensor-parallel-degree",
        "2",
        "--inference-components",
    ]
    assert main([*argv, "--autoscale", "0:2:4", "--scale-metric", "concurrency"]) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--min-instances", "0"], "plain production variant cannot scale to zero"),
        (["--autoscale", "0:2:50"], "plain production variant cannot scale to zero"),
        (["--min-instances", "1", "--max-instances", "2"], "inference components"),
        (["--inference-components", "--min-instances", "0"], "copies"),
        (["--inference-components", "--min-instances", "0", "--autoscale", "1:2:5"], "copies"),
        (["--inference-components", "--accelerators", "8", "--tensor-parallel-degree", "8"], "4 idle"),
        (
            ["--inference-components", "--env", "OPTION_TENSOR_PARALLEL_DEGREE=8", "--accelerators", "2"],
            "cannot hold",
        ),
        (["--instance-type", "ml.inf2.24xlarge", "--tensor-parallel-degree", "24"], "has 6"),
        (["--instance-type", "ml.g5.2xlarge", "--volume-size", "100"], "local NVMe"),
        (["--instance-type", "ml.trn1.32xlarge", "--volume-size", "100"], "local NVMe"),
    ],
)
def test_refused_flags_make_no_aws_call(aws, capsys, extra: list[str], message: str) -> None:
    assert main([*CREATE, *extra]) == 2  # any call would raise: no response is queued
    assert message in capsys.readouterr().err


# --- update --------------------------------------------------------------------------------------


def expect_described(
    sm: Stubber, name: str, config_name: str, current: dict[str, Any], *components: str
) -> None:
    sm.add_response("describe_endpoint", endpoint(name, config_name), {"EndpointName": name})
    sm.add_response(
        "describe_endpoint_config", config(config_name, current), {"EndpointConfigName": config_name}
    )
    sm.add_response("list_inference_components", listed(name, *components), {"EndpointNameEquals": name})


def test_update_plain_endpoint_with_a_new_model_version(aws) -> None:
    sm = aws["sagemaker"]
    expect_described(sm, "m", "m", {"InstanceType": "ml.inf2.xlarge", "ModelName": "m"})
    sm.add_response("create_model", {"ModelArn": arn("model", "m-v2")}, model_request("m-v2", "s3://b/m2/"))
    new = {
        "EndpointConfigName": "m-v2",
        "ProductionVariants": [variant("ml.inf2.xlarge", VolumeSizeInGB=256, **plain("m-v2"))],
    }
    sm.add_response("create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "m-v2")}, new)
    sm.add_response(
        "update_endpoint",
        {"EndpointArn": arn("endpoint", "m")},
        {"EndpointName": "m", "EndpointConfigName": "m-v2"},
    )
    sm.add_response("describe_endpoint", endpoint("m", "m-v2"), {"EndpointName": "m"})
    argv = ["deploy", "update", "--name", "m", "--version", "v2", "--image", IMAGE, "--role", ROLE]
    assert main([*argv, "--model-data", "s3://b/m2/", "--instance-type", "ml.inf2.xlarge", "--wait"]) == 0


def test_update_changing_instance_type_deregisters_the_variant_first(aws, capsys) -> None:
    sm, aas = aws["sagemaker"], aws["application-autoscaling"]
    expect_described(sm, "m", "m-v2", {"InstanceType": "ml.inf2.xlarge", "ModelName": "m-v2"})
    aas.add_response("deregister_scalable_target", {}, target(*VARIANT_TARGET))
    new = {
        "EndpointConfigName": "m-v3",
        "ProductionVariants": [variant("ml.inf2.24xlarge", VolumeSizeInGB=256, **plain("m-v2"))],
    }
    sm.add_response("create_endpoint_config", {"EndpointConfigArn": arn("endpoint-config", "m-v3")}, new)
    sm.add_response(
        "update_endpoint",
        {"EndpointArn": arn("endpoint", "m")},
        {"EndpointName": "m", "EndpointConfigName": "m-v3"},
    )
    assert (
        main(["deploy", "update", "--name", "m", "--version", "v3", "--instance-type", "ml.inf2.24xlarge"])
        == 0
    )
    assert "--autoscale" in capsys.readouterr().err


def test_update_component_in_place(aws) -> None:
    sm = aws["sagemaker"]
    current = variant("ml.inf2.24xlarge", VolumeSizeInGB=256, **managed(1, 1))
    expect_described(sm, "ep", "ep", current, "ep")
    sm.add_response("describe_inference_component", component("ep", "ep"), {"InferenceComponentName": "ep"})
    sm.add_response("create_model", {"ModelArn": arn("model", "ep-v2")}, model_request("ep-v2", "s3://b/e2/"))
    update = {
        "InferenceComponentName": "ep",
        "RuntimeConfig": {"CopyCount": 2},
        "Specification": specification("ep-v2", 4),
    }
    sm.add_response(
        "update_inference_component", {"InferenceComponentArn": arn("inference-component", "ep")}, update
    )
    argv = [
        "deploy",
        "update",
        "--name",
        "ep",
        "--version",
        "v2",
        "--image",
        IMAGE,
        "--role",
        ROLE,
        "--model-data",
        "s3://b/e2/",
        "--inference-components",
        "--copies",
        "2",
        "--instance-type",
        "ml.inf2.24xlarge",
        "--tensor-parallel-degree",
        "8",
    ]
    assert main(argv) == 0  # the variant is unchanged: no new endpoint config, no UpdateEndpoint


def test_update_component_copies_only_keeps_its_model_and_role(aws) -> None:
    sm = aws["sagemaker"]
    current = variant("ml.inf2.24xlarge", VolumeSizeInGB=256, **managed(1, 1))
    sm.add_response("describe_endpoint", endpoint("ep", "ep"), {"EndpointName": "ep"})
    described = {**config("ep", current), "ExecutionRoleArn": ROLE}
    sm.add_response("describe_endpoint_config", described, {"EndpointConfigName": "ep"})
    sm.add_response("list_inference_components", listed("ep", "ep"), {"EndpointNameEquals": "ep"})
    hosted = {**component("ep"), "Specification": specification("ep-v2", 4)}
    sm.add_response("describe_inference_component", hosted, {"InferenceComponentName": "ep"})
    update = {
        "InferenceComponentName": "ep",
        "RuntimeConfig": {"CopyCount": 3},
        "Specification": specification("ep-v2", 4),
    }
    sm.add_response(
        "update_inference_component", {"InferenceComponentArn": arn("inference-component", "ep")}, update
    )
    argv = ["deploy", "update", "--name", "ep", "--inference-components", "--copies", "3"]
    assert main([*argv, "--instance-type", "ml.inf2.24xlarge"]) == 0  # 4 devices per copy, as before


# --- delete --------------------------------------------------------------------------------------


def test_delete_removes_scaling_alarm_component_endpoint_config_and_models(aws, capsys) -> None:
    sm, aas, cloudwatch = aws["sagemaker"], aws["application-autoscaling"], aws["cloudwatch"]
    expect_described(sm, "ep", "ep-v2", {"InstanceType": "ml.inf2.xlarge"}, "ep")
    sm.add_response(
        "describe_inference_component", component("ep", "ep-v2"), {"InferenceComponentName": "ep"}
    )
    aas.add_response(
        "deregister_scalable_target",
        {},
        target("inference-component/ep", "sagemaker:inference-component:DesiredCopyCount"),
    )
    alarms = {"AlarmNames": ["ep-no-capacity"]}
    cloudwatch.add_response("describe_alarms", {"MetricAlarms": [{"AlarmName": "ep-no-capacity"}]}, alarms)
    cloudwatch.add_response("delete_alarms", {}, alarms)
    sm.add_response("delete_inference_component", {}, {"InferenceComponentName": "ep"})
    sm.add_response(
        "describe_inference_component", component("ep", "ep-v2", "Deleting"), {"InferenceComponentName": "ep"}
    )
    not_found(sm, "describe_inference_component", {"InferenceComponentName": "ep"}, "inference component")
    sm.add_response("delete_endpoint", {}, {"EndpointName": "ep"})
    sm.add_response("delete_endpoint_config", {}, {"EndpointConfigName": "ep-v2"})
    sm.add_response("delete_model", {}, {"ModelName": "ep-v2"})
    assert main(["deploy", "delete", "--name", "ep"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "deleted scalable target inference-component/ep",
        "deleted alarm ep-no-capacity",
        "deleted inference component ep",
        "deleted endpoint ep",
        "deleted endpoint config ep-v2",
        "deleted model ep-v2",
    ]


def test_delete_cleans_up_after_an_interrupted_create(aws, capsys) -> None:
    sm = aws["sagemaker"]
    not_found(sm, "describe_endpoint", {"EndpointName": "m"}, 'endpoint "m"')
    sm.add_response("describe_endpoint_config", config("m", {"ModelName": "m"}), {"EndpointConfigName": "m"})
    sm.add_response("delete_endpoint_config", {}, {"EndpointConfigName": "m"})
    sm.add_response("delete_model", {}, {"ModelName": "m"})
    assert main(["deploy", "delete", "--name", "m"]) == 0
    assert capsys.readouterr().out.splitlines() == ["deleted endpoint config m", "deleted model m"]

    not_found(sm, "describe_endpoint", {"EndpointName": "m"}, 'endpoint "m"')
    not_found(sm, "describe_endpoint_config", {"EndpointConfigName": "m"}, 'endpoint configuration "m"')
    not_found(sm, "describe_model", {"ModelName": "m"}, 'model "m"')
    assert main(["deploy", "delete", "--name", "m"]) == 0
    assert "nothing named m" in capsys.readouterr().err

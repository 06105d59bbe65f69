"""Application Auto Scaling for a SageMaker endpoint: instances of a variant, or copies of an
inference component, and scaling an inference-component endpoint to and from zero.

Target tracking follows invocations per minute (``metric="invocations"``) or concurrent requests
(``metric="concurrency"``: SageMaker's high-resolution metrics, which react within seconds), per
variant instance or per component copy: the four predefined metric types in :data:`METRICS`.

Only an endpoint hosting inference components can scale to zero. Its variant's managed instance
scaling has ``MinInstanceCount=0``, each component's copies may fall to zero, and since target
tracking cannot scale out from zero copies, a step-scaling policy adds one copy when the
``NoCapacityInvocationFailures`` CloudWatch alarm fires (a request arrived with no copy to serve it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_lmi.deploy.sagemaker.resources import SCALE_TO_ZERO_HINT

METRICS: dict[tuple[bool, str], str] = {
    (False, "invocations"): "SageMakerVariantInvocationsPerInstance",
    (False, "concurrency"): "SageMakerVariantConcurrentRequestsPerModelHighResolution",
    (True, "invocations"): "SageMakerInferenceComponentInvocationsPerCopy",
    (True, "concurrency"): "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution",
}
NO_CAPACITY_METRIC = "NoCapacityInvocationFailures"


def component_resource(component: str) -> tuple[str, str]:
    """``(ResourceId, ScalableDimension)`` of an inference component's copy count."""
    return f"inference-component/{component}", "sagemaker:inference-component:DesiredCopyCount"


def variant_resource(endpoint: str, variant: str = "AllTraffic") -> tuple[str, str]:
    return f"endpoint/{endpoint}/variant/{variant}", "sagemaker:variant:DesiredInstanceCount"


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    """Target tracking: instances of a variant, or copies of an inference component.

    ``target_value`` is invocations per minute per instance (or copy) for ``metric="invocations"``,
    concurrent requests per model (or copy) for ``metric="concurrency"``. Scale-out reacts fast;
    scale-in waits longer because a new Neuron replica takes minutes to load. ``min_capacity=0`` is
    for inference components only (see :class:`ScaleFromZeroSpec`).
    """

    endpoint_name: str
    variant_name: str = "AllTraffic"
    inference_component: str | None = None
    min_capacity: int = 1
    max_capacity: int = 4
    target_value: float = 60.0
    metric: str = "invocations"
    scale_out_cooldown_s: int = 60
    scale_in_cooldown_s: int = 600

    def validate(self) -> None:
        if not 0 <= self.min_capacity <= self.max_capacity or self.max_capacity < 1:
            raise ValueError(
                f"capacity {self.min_capacity}..{self.max_capacity}: need 0 <= min <= max, max >= 1"
            )
        if self.min_capacity == 0 and not self.inference_component:
            raise ValueError(f"min_capacity=0: {SCALE_TO_ZERO_HINT}")
        if self.target_value <= 0:
            raise ValueError(f"target_value={self.target_value}: must be > 0")
        if (False, self.metric) not in METRICS:
            raise ValueError(f"metric={self.metric!r}: choose invocations or concurrency")

    @property
    def scales_to_zero(self) -> bool:
        return self.inference_component is not None and self.min_capacity == 0

    @property
    def resource(self) -> tuple[str, str]:
        if self.inference_component:
            return component_resource(self.inference_component)
        return variant_resource(self.endpoint_name, self.variant_name)

    def target_request(self) -> dict[str, Any]:
        self.validate()
        resource_id, dimension = self.resource
        return {
            "ServiceNamespace": "sagemaker",
            "ResourceId": resource_id,
            "ScalableDimension": dimension,
            "MinCapacity": self.min_capacity,
            "MaxCapacity": self.max_capacity,
        }

    def policy_request(self) -> dict[str, Any]:
        self.validate()
        resource_id, dimension = self.resource
        metric = METRICS[(self.inference_component is not None, self.metric)]
        return {
            "PolicyName": f"{resource_id.replace('/', '-')}-{self.metric}",
            "ServiceNamespace": "sagemaker",
            "ResourceId": resource_id,
            "ScalableDimension": dimension,
            "PolicyType": "TargetTrackingScaling",
            "TargetTrackingScalingPolicyConfiguration": {
                "TargetValue": float(self.target_value),
                "PredefinedMetricSpecification": {"PredefinedMetricType": metric},
                "ScaleOutCooldown": self.scale_out_cooldown_s,
                "ScaleInCooldown": self.scale_in_cooldown_s,
            },
        }


@dataclass(frozen=True, slots=True)
class ScaleFromZeroSpec:
    """Step scaling that adds ``step`` copies of a component with none when a request finds no
    capacity: the policy, and the CloudWatch alarm on ``NoCapacityInvocationFailures`` that fires it
    (any failure within one ``period_s`` window)."""

    inference_component: str
    step: int = 1
    cooldown_s: int = 60
    period_s: int = 60

    @property
    def alarm_name(self) -> str:
        return f"{self.inference_component}-no-capacity"

    def policy_request(self) -> dict[str, Any]:
        if self.step < 1:
            raise ValueError(f"step={self.step}: must be >= 1")
        resource_id, dimension = component_resource(self.inference_component)
        return {
            "PolicyName": f"{resource_id.replace('/', '-')}-from-zero",
            "ServiceNamespace": "sagemaker",
            "ResourceId": resource_id,
            "ScalableDimension": dimension,
            "PolicyType": "StepScaling",
            "StepScalingPolicyConfiguration": {
                "AdjustmentType": "ChangeInCapacity",
                "MetricAggregationType": "Maximum",
                "Cooldown": self.cooldown_s,
                "StepAdjustments": [{"MetricIntervalLowerBound": 0.0, "ScalingAdjustment": self.step}],
            },
        }

    def alarm_request(self, policy_arn: str) -> dict[str, Any]:
        return {
            "AlarmName": self.alarm_name,
            "AlarmDescription": f"{self.inference_component} was invoked with no copy: add {self.step}",
            "AlarmActions": [policy_arn],
            "MetricName": NO_CAPACITY_METRIC,
            "Namespace": "AWS/SageMaker",
            "Statistic": "Sum",
            "Dimensions": [{"Name": "InferenceComponentName", "Value": self.inference_component}],
            "Period": self.period_s,
            "EvaluationPeriods": 1,
            "DatapointsToAlarm": 1,
            "Threshold": 1.0,
            "ComparisonOperator": "GreaterThanOrEqualToThreshold",
            "TreatMissingData": "missing",
        }


def enable_autoscaling(autoscaling: Any, spec: AutoscalingSpec) -> str:
    """Register the scalable target and attach the target-tracking policy; returns the policy ARN."""
    autoscaling.register_scalable_target(**spec.target_request())
    return str(autoscaling.put_scaling_policy(**spec.policy_request())["PolicyARN"])


def enable_scale_from_zero(autoscaling: Any, cloudwatch: Any, spec: ScaleFromZeroSpec) -> str:
    """The step-scaling policy (on an already registered component target) and its alarm;
    returns the alarm name."""
    policy_arn = str(autoscaling.put_scaling_policy(**spec.policy_request())["PolicyARN"])
    cloudwatch.put_metric_alarm(**spec.alarm_request(policy_arn))
    return spec.alarm_name


def check_instance_scaling(min_instances: int | None, scaling: AutoscalingSpec | None) -> None:
    """An inference-component endpoint reaches zero instances only when its copies can reach zero."""
    if min_instances == 0 and (scaling is None or not scaling.scales_to_zero):
        raise ValueError(
            "min_instances=0: instances reach zero only when the component's copies do; add "
            "--autoscale 0:MAX:TARGET so copies scale to zero and back (NoCapacityInvocationFailures alarm)"
        )

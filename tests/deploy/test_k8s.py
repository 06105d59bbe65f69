"""Kubernetes manifests: schema-valid offline for a pinned Kubernetes version, with the fields that
make a rollout safe (probes, drain time, device requests) checked one by one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from neuron_lmi.config import ServingConfig, load_config

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # pinned: an EKS standard-support version
VARIANTS = {"inf2": "aws.amazon.com/neuron", "cuda": "nvidia.com/gpu"}


def documents(variant: str) -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((K8S_DIR / f"neuron-lmi-{variant}.yaml").read_text()))
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object of each kind per file"
    return by_kind


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_validate_offline(variant: str) -> None:
    docs = documents(variant)
    assert set(docs) == {
        "ConfigMap",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    for doc in docs.values():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_is_strict() -> None:
    deployment = documents("inf2")["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(("variant", "device"), VARIANTS.items())
def test_deployment_fields(variant: str, device: str) -> None:
    docs = documents(variant)
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"][device] == container["resources"]["requests"][device]
    assert int(container["resources"]["limits"][device]) >= 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/ping"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/ping"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "loading takes minutes"
    assert {"containerPort": 8080, "name": "http", "protocol": "TCP"} in container["ports"]
    assert pod["tolerations"][0]["key"] == device

    # the pod outlives the server's drain: preStop sleep + grace period + margin
    env = docs["ConfigMap"]["data"]
    grace = float(env.get("SERVING_GRACE_PERIOD_S", ServingConfig().server.grace_period_s))
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace >= 30

    labels = docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert docs["Service"]["spec"]["selector"] == labels
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "http"
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    assert hpa["minReplicas"] > docs["PodDisruptionBudget"]["spec"]["minAvailable"], "a node can drain"
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("variant", VARIANTS)
def test_configmap_is_a_valid_neuron_lmi_config(variant: str, tmp_path: Path) -> None:
    env = {**documents(variant)["ConfigMap"]["data"], "SM_MODEL_DIR": str(tmp_path)}
    resolved = load_config(None, None, env)
    assert resolved.ignored == {}, resolved.ignored
    assert resolved.config.backend.backend == env["OPTION_BACKEND"]
    assert resolved.config.model.model_id == env["HF_MODEL_ID"]

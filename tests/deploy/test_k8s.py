"""Kubernetes manifests: built-in kinds schema-valid offline for a pinned Kubernetes version, KEDA's
ScaledObject checked against an explicit schema of the fields used (its CRD is not in
kubernetes-validate), and the fields that make a rollout safe checked one by one."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from neuron_lmi.config import ServingConfig, load_config

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

K8S_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
README = K8S_DIR.parent / "README.md"
KUBERNETES_VERSION = "1.33.0"  # pinned: an EKS standard-support version
VARIANTS = {"inf2": "aws.amazon.com/neuron", "cuda": "nvidia.com/gpu"}
NEURON_SCHEDULER = "my-scheduler"  # the scheduler the Neuron Helm chart installs with its extension
CACHE_VARIABLES = ("HF_HOME", "NEURON_LMI_CACHE_DIR", "NEURON_LMI_MODEL_CACHE")
IAM_ROLE = re.compile(r"arn:aws:iam::\d{12}:role/[\w+=,.@/-]+")

_STRING = {"type": "string", "minLength": 1}
_COUNT = {"type": "integer", "minimum": 0}
# The part of KEDA's ScaledObject CRD (keda.sh/v1alpha1, KEDA 2.x) these manifests use; anything else
# is an error, so a typo fails here instead of being ignored by the API server's pruning.
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {"apiVersion": _STRING, "kind": _STRING, "name": _STRING},
                },
                "minReplicaCount": _COUNT,
                "maxReplicaCount": _COUNT,
                "pollingInterval": _COUNT,
                "cooldownPeriod": _COUNT,
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": _STRING, "behavior": {"type": "object"}},
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"const": "prometheus"},
                            "metricType": {"enum": ["AverageValue", "Value"]},
                            "metadata": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["serverAddress", "query", "threshold"],
                                "properties": {
                                    "serverAddress": {"type": "string", "pattern": "^https?://"},
                                    "query": _STRING,
                                    # KEDA trigger metadata values are strings
                                    "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                                    "activationThreshold": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def load(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((K8S_DIR / name).read_text()))


def documents(variant: str) -> dict[str, dict[str, Any]]:
    docs = load(f"neuron-lmi-{variant}.yaml")
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object of each kind per file"
    return by_kind


def server(docs: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_validate_offline(variant: str) -> None:
    docs = documents(variant)
    assert set(docs) == {
        "ConfigMap",
        "ServiceAccount",
        "Deployment",
        "Service",
        "ScaledObject",
        "PodDisruptionBudget",
    }
    for kind, doc in docs.items():
        if kind == "ScaledObject":
            jsonschema.validate(doc, SCALED_OBJECT_SCHEMA)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_neuron_monitor_daemonset_validates_offline() -> None:
    (daemonset,) = load("neuron-monitor.yaml")
    kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


def test_validation_is_strict() -> None:
    deployment = documents("inf2")["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    scaled = documents("inf2")["ScaledObject"]
    scaled["spec"]["minReplicas"] = 2  # the HPA's spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCALED_OBJECT_SCHEMA)


@pytest.mark.parametrize(("variant", "device"), VARIANTS.items())
def test_deployment_fields(variant: str, device: str) -> None:
    docs = documents(variant)
    pod, container = server(docs)
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


@pytest.mark.parametrize("variant", VARIANTS)
def test_downloads_and_compile_caches_land_on_a_mounted_volume(variant: str) -> None:
    """Every cache variable points inside a writable volume mounted in the server container, never
    into the container's own layer (lost on restart, counted against node ephemeral storage)."""
    docs = documents(variant)
    pod, container = server(docs)
    env = docs["ConfigMap"]["data"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [m for m in container["volumeMounts"] if not m.get("readOnly")]
    for name in CACHE_VARIABLES:
        path = PurePosixPath(env[name])
        mount = next((m for m in mounts if path.is_relative_to(m["mountPath"])), None)
        assert mount is not None, f"{name}={path} is on no mounted volume"
        volume = volumes[mount["name"]]
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume or "ephemeral" in volume, volume
        assert volume.get("emptyDir", {}).get("medium") != "Memory", f"{name} would fill RAM"


@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_needing_several_devices_use_the_neuron_scheduler_extension(variant: str) -> None:
    pod, container = server(documents(variant))
    neuron = int(container["resources"]["limits"].get("aws.amazon.com/neuron", 0))
    cores = int(container["resources"]["limits"].get("aws.amazon.com/neuroncore", 0))
    if neuron > 1 or cores > 1:
        assert pod.get("schedulerName") == NEURON_SCHEDULER
    else:
        assert "schedulerName" not in pod, "GPU and single-device pods keep the default scheduler"
    readme = README.read_text()
    assert f"schedulerName: {NEURON_SCHEDULER}" in readme and "scheduler.enabled=true" in readme


@pytest.mark.parametrize("variant", VARIANTS)
def test_service_account_grants_s3_access(variant: str) -> None:
    docs = documents(variant)
    pod, _ = server(docs)
    account = docs["ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod.get("automountServiceAccountToken", True), "IRSA needs the projected token"
    assert IAM_ROLE.fullmatch(account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"])
    readme = README.read_text()
    assert "eks.amazonaws.com/role-arn" in readme and "create-pod-identity-association" in readme


@pytest.mark.parametrize("variant", VARIANTS)
def test_keda_scales_the_deployment_on_the_queue(variant: str) -> None:
    docs = documents(variant)
    spec = docs["ScaledObject"]["spec"]
    deployment = docs["Deployment"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert spec["minReplicaCount"] > docs["PodDisruptionBudget"]["spec"]["minAvailable"], "a node can drain"
    assert spec["maxReplicaCount"] > spec["minReplicaCount"]
    (trigger,) = spec["triggers"]
    query = trigger["metadata"]["query"]
    assert query.startswith("sum(neuron_lmi_queue_length{")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for key, value in labels.items():  # Prometheus' kubernetes-pods job maps pod labels like this
        assert f'{re.sub(r"[^a-zA-Z0-9_]", "_", key)}="{value}"' in query
    pod_annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert pod_annotations["prometheus.io/scrape"] == "true"

    # KEDA hands the behavior to the HPA it creates: validate it as autoscaling/v2 does.
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300, "replicas load slowly"
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-check"},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": behavior,
        },
    }
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


def test_neuron_monitor_is_scraped_beside_the_server() -> None:
    (daemonset,) = load("neuron-monitor.yaml")
    template = daemonset["spec"]["template"]
    (container,) = template["spec"]["containers"]
    command = " ".join([*container.get("command", []), *container.get("args", [])])
    assert "neuron-monitor |" in command and "neuron-monitor-prometheus.py" in command
    annotations = template["metadata"]["annotations"]
    ports = {p["containerPort"] for p in container["ports"]}
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) in ports
    assert f"--port {annotations['prometheus.io/port']}" in command
    assert template["spec"]["tolerations"][0]["key"] == "aws.amazon.com/neuron"
    _, server_container = server(documents("inf2"))
    server_port = documents("inf2")["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert server_port["prometheus.io/path"] == annotations["prometheus.io/path"] == "/metrics"
    assert server_container["ports"][0]["containerPort"] not in ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_configmap_is_a_valid_neuron_lmi_config(variant: str, tmp_path: Path) -> None:
    env = {**documents(variant)["ConfigMap"]["data"], "SM_MODEL_DIR": str(tmp_path)}
    resolved = load_config(None, None, env)
    assert resolved.ignored == {}, resolved.ignored
    assert resolved.config.backend.backend == env["OPTION_BACKEND"]
    assert resolved.config.model.model_id == env["HF_MODEL_ID"]

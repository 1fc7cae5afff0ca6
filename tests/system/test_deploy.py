"""deploy/: the Dockerfile and the Kubernetes manifests, checked without a cluster and without Docker.

How the manifests are validated:

- Core Kubernetes objects (Namespace, ServiceAccount, ConfigMap, Secret, Service) and every Job template
  of the JobSet (wrapped into a ``batch/v1`` Job, so the whole pod template is covered: containers, the
  native-sidecar init container, probes, volumes, resources) are validated against the **upstream
  Kubernetes JSON schemas** shipped offline by the ``kubernetes-validate`` package, in its *strict* mode
  (an unknown or misspelt field is an error), for the oldest Kubernetes with native sidecars on by
  default (1.29) and the newest the package ships. ``test_schema_validation_is_strict`` proves that the
  validator really rejects what it should.
- The custom resources (JobSet, PodMonitoring, ServiceMonitor) have no schema in that package. They are
  checked against small strict JSON schemas written below from the upstream API types
  (kubernetes-sigs/jobset ``api/jobset/v1alpha2``, GoogleCloudPlatform/prometheus-engine's PodMonitoring
  CRD, prometheus-operator's ServiceMonitor): the fields these manifests use and their close neighbours,
  ``additionalProperties: false`` everywhere. Not the full CRDs: a field they do not list fails here
  even where the real CRD would accept it (add it to the schema then).
- The JobSet's shape and the wiring between objects (ports, paths, labels, names, the token, the
  settings) are checked explicitly, and the sidecar's command is run for real with the ConfigMap's
  settings: ``ckptd serve`` must answer ``/readyz`` 200.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient
from pydantic import ValidationError

from ckptd.api._app import create_app
from ckptd.config import Settings
from tests.support.helpers import REPO, clean_env, make_settings, stop_process, wait_until
from trainer_client.config import ClientSettings
from trainer_client.core import protocol as p

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"

# Native sidecars (init containers with restartPolicy: Always) are on by default from 1.29 (GA in 1.33).
K8S_VERSIONS = ("1.29", ".".join(kubernetes_validate.latest_version().split(".")[:2]))
# Files in deploy/k8s that kustomization.yaml leaves out on purpose (docs/deploy.md says why).
NOT_IN_KUSTOMIZATION = {"secret.example.yaml", "servicemonitor.yaml", "prometheusrule.yaml"}
SIDECAR = "ckptd"
TRAINER = "trainer"
ENV_PREFIX = "CKPTD_"

# ---- loading ---------------------------------------------------------------------------------------


def _load(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"
    return docs


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in _manifest_files() for doc in _load(path)]


def _one(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in _objects() if doc.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def _only(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [i for i in items if i.get("name") == name]
    assert len(found) == 1, f"expected exactly one item named {name!r}, found {len(found)}"
    return found[0]


def _pod_spec(jobset: dict[str, Any]) -> dict[str, Any]:
    jobs = jobset["spec"]["replicatedJobs"]
    assert len(jobs) == 1, "one replicated job (the TPU slices) is expected"
    spec: dict[str, Any] = jobs[0]["template"]["spec"]["template"]["spec"]
    return spec


def _pod_labels(jobset: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"]
    return labels


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    return _only(pod.get("initContainers", []), SIDECAR)


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return _only(pod["containers"], TRAINER)


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _config() -> dict[str, str]:
    data: dict[str, str] = _one("ConfigMap")["data"]
    return data


def _sidecar_port(pod: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's API port (API, probes and metrics); the only other one is the peer channel's."""
    ports = _sidecar(pod)["ports"]
    assert {p["name"] for p in ports} <= {"ckptd", "ckptd-peer"}, ports
    port: dict[str, Any] = _only(ports, "ckptd")
    return port


def _resolve_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or a monitor's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return int(_only(container["ports"], port)["containerPort"])


# ---- generic checks --------------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _check_labels(labels: dict[str, Any], where: str) -> None:
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        assert not prefix or (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix)), f"{where}: label key {key!r}"
        assert _LABEL_NAME.match(name), f"{where}: label key {key!r}"
        assert isinstance(value, str) and _LABEL_VALUE.match(value), f"{where}: label {key}={value!r}"


def _walk_labels(doc: dict[str, Any], where: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every labels map and matchLabels selector in an object."""
    stack: list[tuple[Any, str]] = [(doc, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("labels", "matchLabels") and isinstance(value, dict):
                    yield value, f"{path}.{key}"
                else:
                    stack.append((value, f"{path}.{key}"))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))


_QUANTITY = re.compile(r"^([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_SUFFIX = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}


def _quantity(value: str | int) -> float:
    m = _QUANTITY.match(str(value))
    assert m, f"not a Kubernetes quantity: {value!r}"
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def test_every_manifest_is_a_named_object_in_one_namespace() -> None:
    objects = _objects()
    assert {doc["kind"] for _, doc in objects} >= {
        "Namespace", "ServiceAccount", "ConfigMap", "Secret", "Service", "NetworkPolicy", "JobSet", "PodMonitoring",
        "ServiceMonitor",
    }
    namespace = _one("Namespace")["metadata"]["name"]
    for path, doc in objects:
        where = f"{path.name}: {doc.get('kind')}"
        assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str), where
        assert _DNS_LABEL.match(doc["metadata"]["name"]), where
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, where
        for labels, at in _walk_labels(doc, where):
            _check_labels(labels, at)


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = _load(K8S / "kustomization.yaml")
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == _one("Namespace")["metadata"]["name"]
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    for name in resources:
        assert (K8S / name).is_file(), f"kustomization.yaml lists {name}, which does not exist"
    on_disk = {p.name for p in _manifest_files()}
    assert set(resources) == on_disk - NOT_IN_KUSTOMIZATION
    assert on_disk >= NOT_IN_KUSTOMIZATION
    # The Namespace must exist before anything is created in it.
    assert resources[0] == "namespace.yaml"


# ---- schemas: core objects (upstream Kubernetes JSON schemas, strict) -------------------------------

CORE_KINDS = ("Namespace", "ServiceAccount", "ConfigMap", "Secret", "Service", "NetworkPolicy")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", CORE_KINDS)
def test_core_objects_match_the_kubernetes_schema(kind: str, version: str) -> None:
    kubernetes_validate.validate(_one(kind), version, strict=True)


def _as_job(replicated_job: dict[str, Any]) -> dict[str, Any]:
    """A JobSet's replicated-job template (a batch/v1 JobTemplateSpec) as the Job it becomes."""
    template = replicated_job["template"]
    metadata = {"name": replicated_job["name"], **template.get("metadata", {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": template["spec"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_jobset_job_and_pod_templates_match_the_kubernetes_schema(version: str) -> None:
    for replicated_job in _one("JobSet")["spec"]["replicatedJobs"]:
        kubernetes_validate.validate(_as_job(replicated_job), version, strict=True)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda pod: _sidecar(pod).__setitem__("restartPolicyy", "Always"), "restartPolicyy"),
        (lambda pod: _sidecar(pod)["readinessProbe"]["httpGet"].__setitem__("paht", "/readyz"), "paht"),
        (lambda pod: _sidecar(pod)["ports"][0].__setitem__("containerPort", "9471"), "9471"),
        (lambda pod: _trainer(pod).__setitem__("envFrom", {"configMapRef": {"name": "x"}}), "envFrom"),
        (lambda pod: pod.__setitem__("serviceAcountName", "x"), "serviceAcountName"),
    ],
    ids=["unknown-field", "nested-typo", "wrong-type", "list-as-map", "pod-typo"],
)
def test_schema_validation_is_strict(mutate: Callable[[dict[str, Any]], None], expected: str) -> None:
    """The validator used above is not a rubber stamp: a broken pod template fails."""
    jobset = _one("JobSet")
    mutate(_pod_spec(jobset))
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        kubernetes_validate.validate(_as_job(jobset["spec"]["replicatedJobs"][0]), K8S_VERSIONS[0], strict=True)
    error = info.value
    assert expected in f"{'.'.join(str(x) for x in error.path)}: {error.message}"


# ---- schemas: custom resources (minimal strict schemas written from the upstream API types) ---------


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _array(items: dict[str, Any], min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items}


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_UINT = {"type": "integer", "minimum": 0}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_NAME = {"type": "string", "pattern": _DNS_LABEL.pattern}
_DURATION = {"type": "string", "pattern": r"^((\d+)y)?((\d+)w)?((\d+)d)?((\d+)h)?((\d+)m)?((\d+)s)?((\d+)ms)?$",
             "minLength": 2}
_METADATA = _obj({"name": _NAME, "namespace": _NAME, "labels": _STR_MAP, "annotations": _STR_MAP},
                 required=("name",))
_LABEL_SELECTOR = _obj({
    "matchLabels": {**_STR_MAP, "minProperties": 1},
    "matchExpressions": _array(_obj({"key": _STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                     "values": _array(_STR)}, required=("key", "operator"))),
})
_SECRET_KEY = _obj({"name": _STR, "key": _STR, "optional": _BOOL}, required=("key",))


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _obj({"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _METADATA,
                 "spec": spec}, required=("apiVersion", "kind", "metadata", "spec"))


# jobset.x-k8s.io/v1alpha2 JobSetSpec (kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go). Each
# replicated job's template is a batch/v1 JobTemplateSpec, validated with the Kubernetes schema above.
JOBSET_SCHEMA = _resource("jobset.x-k8s.io/v1alpha2", "JobSet", _obj({
    "replicatedJobs": _array(_obj({
        "name": _NAME,
        "groupName": _STR,
        "replicas": {"type": "integer", "minimum": 1},
        "template": _obj({"metadata": {"type": "object"}, "spec": {"type": "object"}}, required=("spec",)),
        "dependsOn": _array(_obj({"name": _STR, "status": {"enum": ["Ready", "Complete"]}},
                                 required=("name", "status"))),
    }, required=("name", "template")), min_items=1),
    "network": _obj({"enableDNSHostnames": _BOOL, "subdomain": _STR, "publishNotReadyAddresses": _BOOL}),
    "successPolicy": _obj({"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _array(_STR)},
                          required=("operator",)),
    "failurePolicy": _obj({
        "maxRestarts": _UINT,
        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
        "rules": _array(_obj({
            "name": _STR,
            "action": {"enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
                                "RestartJobAndIgnoreMaxRestarts"]},
            "onJobFailureReasons": _array(_STR), "onJobFailureMessagePatterns": _array(_STR),
            "targetReplicatedJobs": _array(_STR),
        }, required=("name", "action"))),
    }),
    "startupPolicy": _obj({"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}, required=("startupPolicyOrder",)),
    "suspend": _BOOL,
    "coordinator": _obj({"replicatedJob": _STR, "jobIndex": _UINT, "podIndex": _UINT}, required=("replicatedJob",)),
    "managedBy": _STR,
    "ttlSecondsAfterFinished": _UINT,
}, required=("replicatedJobs",)))

# monitoring.googleapis.com/v1 PodMonitoring (GKE managed Prometheus; prometheus-engine's CRD).
PODMONITORING_SCHEMA = _resource("monitoring.googleapis.com/v1", "PodMonitoring", _obj({
    "selector": _LABEL_SELECTOR,
    "endpoints": _array(_obj({
        "port": {"type": ["string", "integer"]},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "timeout": _DURATION,
        "params": {"type": "object"},
        "metricRelabeling": _array({"type": "object"}),
        "authorization": {"type": "object"},
        "basicAuth": {"type": "object"},
        "oauth2": {"type": "object"},
        "tls": {"type": "object"},
        "proxyUrl": _STR,
    }, required=("port",)), min_items=1),
    "targetLabels": _obj({
        "metadata": _array({"enum": ["container", "node", "pod", "top_level_controller_name",
                                     "top_level_controller_type"]}),
        "fromPod": _array(_obj({"from": _STR, "to": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
                               required=("from",))),
    }),
    "limits": _obj({"samples": _UINT, "labels": _UINT, "labelNameLength": _UINT, "labelValueLength": _UINT}),
    "filterRunning": _BOOL,
}, required=("selector", "endpoints")))

# monitoring.coreos.com/v1 ServiceMonitor (prometheus-operator).
SERVICEMONITOR_SCHEMA = _resource("monitoring.coreos.com/v1", "ServiceMonitor", _obj({
    "selector": _LABEL_SELECTOR,
    "namespaceSelector": _obj({"any": _BOOL, "matchNames": _array(_STR)}),
    "endpoints": _array(_obj({
        "port": _STR,
        "targetPort": {"type": ["string", "integer"]},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": _BOOL,
        "honorTimestamps": _BOOL,
        "params": {"type": "object"},
        "relabelings": _array({"type": "object"}),
        "metricRelabelings": _array({"type": "object"}),
        "authorization": _obj({"type": _STR, "credentials": _SECRET_KEY}),
        "bearerTokenSecret": _SECRET_KEY,
        "tlsConfig": {"type": "object"},
    }), min_items=1),
    "jobLabel": _STR,
    "targetLabels": _array(_STR),
    "podTargetLabels": _array(_STR),
    "sampleLimit": _UINT,
    "targetLimit": _UINT,
}, required=("selector",)))

CRD_SCHEMAS = {"JobSet": JOBSET_SCHEMA, "PodMonitoring": PODMONITORING_SCHEMA, "ServiceMonitor": SERVICEMONITOR_SCHEMA}


@pytest.mark.parametrize("kind", sorted(CRD_SCHEMAS))
def test_custom_resources_match_their_schema(kind: str) -> None:
    schema = CRD_SCHEMAS[kind]
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(_one(kind))


def test_custom_resource_schemas_are_strict() -> None:
    jobset = _one("JobSet")
    jobset["spec"]["replicatedJob"] = jobset["spec"].pop("replicatedJobs")  # the classic typo
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(jobset, JOBSET_SCHEMA)
    monitor = _one("PodMonitoring")
    monitor["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, PODMONITORING_SCHEMA)


# ---- the JobSet, explicitly -------------------------------------------------------------------------


def test_jobset_is_a_multislice_tpu_v5e_job() -> None:
    jobset = _one("JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset["kind"] == "JobSet"
    (slices,) = jobset["spec"]["replicatedJobs"]
    assert slices["replicas"] >= 2, "multi-slice: one Job per slice, at least two"
    job = slices["template"]["spec"]
    pod = job["template"]["spec"]
    assert job["completionMode"] == "Indexed"
    selector = pod["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    topology = selector["cloud.google.com/gke-tpu-topology"]
    assert re.fullmatch(r"\d+x\d+", topology), "v5e topologies are 2-D"
    chips_per_slice = 1
    for dim in topology.split("x"):
        chips_per_slice *= int(dim)
    trainer = _trainer(pod)
    resources = trainer["resources"]
    chips_per_host = int(resources["limits"]["google.com/tpu"])
    assert int(resources["requests"]["google.com/tpu"]) == chips_per_host
    # One pod per TPU host: the pods of one Job cover the slice exactly.
    assert chips_per_host in (1, 4, 8)
    assert job["parallelism"] == job["completions"] == chips_per_slice // chips_per_host
    # The JobSet controller keeps each slice on its own node pool.
    annotations = jobset["metadata"]["annotations"]
    assert annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"


def test_a_failed_trainer_restarts_in_place_keeping_its_sidecar_and_shared_memory() -> None:
    """docs/multihost.md, section 8: a lost host aborts every trainer (jax's heartbeat); each trainer container
    restarts in its pod, so the ckptd sidecar and the memory-backed /dev/shm stay and the job resumes from memory.
    The Job's backoffLimit allows several such restarts of all its pods; the JobSet's policy is the fallback."""
    jobset = _one("JobSet")
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure", "Never would recreate the pod: sidecar and shared memory gone"
    assert "podFailurePolicy" not in job, "Kubernetes allows podFailurePolicy only with restartPolicy Never"
    assert job["backoffLimit"] >= 2 * job["parallelism"], "every lost host restarts all the Job's trainers"
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1, "the JobSet recreates everything as the fallback"
    shm = _only(pod["volumes"], "shm")
    assert shm["emptyDir"]["medium"] == "Memory" and "sizeLimit" in shm["emptyDir"]
    sidecar, trainer = _sidecar(pod), _trainer(pod)
    for container in (sidecar, trainer):
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert _env(container)["CKPTD_SHM_DIR"]["value"] == "/dev/shm/ckptd/tier"
    user = sidecar["securityContext"]["runAsUser"]
    assert trainer["securityContext"]["runAsUser"] == user, "the memory tier is private to one user"
    heartbeat = _env(trainer)["CKPTD_HEARTBEAT_TIMEOUT_S"]["value"]
    assert ClientSettings(heartbeat_timeout_s=heartbeat).heartbeat_timeout_s == 10
    assert int(heartbeat) < pod["terminationGracePeriodSeconds"]


def test_ckptd_is_a_native_sidecar_running_ckptd_serve() -> None:
    pod = _pod_spec(_one("JobSet"))
    sidecar = _sidecar(pod)
    assert sidecar["restartPolicy"] == "Always", "a native sidecar is an init container with restartPolicy: Always"
    assert SIDECAR not in {c["name"] for c in pod["containers"]}
    assert sidecar["command"][:2] == ["ckptd", "serve"]
    assert "google.com/tpu" not in str(sidecar.get("resources")), "the sidecar must not take TPU chips"
    # The sidecar must not claim a port that the TPU runtime uses in the same network namespace.
    port = _sidecar_port(pod)["containerPort"]
    trainer_ports = {p["containerPort"] for p in _trainer(pod).get("ports", [])}
    assert port not in trainer_ports
    assert port not in TPU_PORTS, "8470-8479 (libtpu), 8080 (Megascale), 8431 (TPU metrics) are taken"


# libtpu takes 8470-8479 on TPU VMs, Megascale 8080, the TPU runtime metrics 8431: all in the pod's namespace.
TPU_PORTS = {*range(8470, 8480), 8080, 8431}


def test_one_default_port_everywhere_and_clear_of_the_tpu_runtime() -> None:
    """ckptd's default port, the trainer library's default URL, the image and the manifests name one port,
    and it is none that the TPU runtime uses beside the sidecar."""
    assert p.DEFAULT_PORT not in TPU_PORTS
    assert Settings.setting_fields()["port"].default == p.DEFAULT_PORT
    assert ClientSettings.model_fields["url"].default == f"http://127.0.0.1:{p.DEFAULT_PORT}"
    stage = _final_stage()
    assert [a for ins, a in stage if ins == "EXPOSE"] == [str(p.DEFAULT_PORT)]
    assert f"CKPTD_PORT={p.DEFAULT_PORT}" in " ".join(a for ins, a in stage if ins == "ENV")
    assert f"'CKPTD_PORT', '{p.DEFAULT_PORT}'" in " ".join(_healthcheck_command())
    pod = _pod_spec(_one("JobSet"))
    assert _sidecar_port(pod)["containerPort"] == int(_config()["CKPTD_PORT"]) == p.DEFAULT_PORT
    # and no page tells a reader that ckptd listens anywhere else by default
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), DOCKERFILE]
    for page in pages:
        for port in TPU_PORTS:
            for spelled in (f"127.0.0.1:{port}", f"localhost:{port}", f"--port {port}", f"CKPTD_PORT={port}"):
                assert spelled not in page.read_text(), (page.name, spelled)


def test_sidecar_configuration_comes_from_the_configmap() -> None:
    config_map = _one("ConfigMap")
    pod = _pod_spec(_one("JobSet"))
    sidecar = _sidecar(pod)
    assert sidecar["envFrom"] == [{"configMapRef": {"name": config_map["metadata"]["name"]}}]
    # Every key is a real ckptd setting (no typo silently ignored: Settings ignores unknown variables).
    fields = set(Settings.setting_fields())
    for key in config_map["data"]:
        assert key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in fields, f"{key} is not a setting"
    assert f"{ENV_PREFIX}TOKEN" not in config_map["data"], "the token belongs in the Secret"
    assert all(isinstance(v, str) for v in config_map["data"].values()), "ConfigMap values must be strings"
    port = _sidecar_port(pod)["containerPort"]
    assert int(config_map["data"]["CKPTD_PORT"]) == port
    assert config_map["data"]["CKPTD_HOST"] == "0.0.0.0", "probes and Prometheus connect to the pod IP"
    assert config_map["data"]["CKPTD_ROOT"].startswith("gs://")
    # The state dir is a writable volume (the root filesystem is read-only).
    mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert config_map["data"]["CKPTD_STATE_DIR"] in mounts
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_sidecars_of_a_multi_host_jobset_share_the_root_under_a_leader_lease() -> None:
    """Several pods (one ckptd each) watch one root: without the lease every sidecar would write the same
    records into the same steps (last write wins; one sidecar's read error would quarantine a step for all)."""
    jobset = _one("JobSet")
    pods = sum(rj["replicas"] * rj["template"]["spec"].get("parallelism", 1)
               for rj in jobset["spec"]["replicatedJobs"])
    assert pods > 1
    assert float(_config()["CKPTD_LEASE_TTL_S"]) >= 10, "a TTL the sidecars can renew in time on GCS"


def test_configmap_values_are_valid_settings(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    values: dict[str, Any] = {key[len(ENV_PREFIX):].lower(): value for key, value in _config().items()}
    values.update(token=None, token_file=str(token_file))
    settings = Settings(**values)
    assert settings.serve.port == _sidecar_port(_pod_spec(_one("JobSet")))["containerPort"]
    assert settings.auth.token == "t0ken"
    # SIGTERM: ckptd persists what trainers handed over, and is done before Kubernetes would SIGKILL it
    grace = _pod_spec(_one("JobSet"))["terminationGracePeriodSeconds"]
    assert 0 < settings.memory_tier.drain_timeout_s <= grace - 10


def test_probes_hit_readyz_and_healthz_on_the_sidecar_port() -> None:
    pod = _pod_spec(_one("JobSet"))
    sidecar = _sidecar(pod)
    port = _sidecar_port(pod)["containerPort"]
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = sidecar[probe]["httpGet"]
        assert _resolve_port(sidecar, get["port"]) == port, probe
        assert get.get("scheme", "HTTP") == "HTTP", probe
        paths[probe] = get["path"]
    # Ready = the catalog is built from storage; alive = the process serves HTTP. The startup probe gates
    # the trainer's start (native sidecar), so it asks only for a serving process: training never waits
    # for a storage scan.
    assert paths == {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    startup = sidecar["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30, "give the process time to import and bind"


def test_sidecar_has_bounded_resources() -> None:
    resources = _sidecar(_pod_spec(_one("JobSet")))["resources"]
    for name in ("cpu", "memory"):
        assert name in resources["requests"] and name in resources["limits"], name
    for name, request in resources["requests"].items():
        assert _quantity(request) <= _quantity(resources["limits"][name]), name


def test_trainer_reaches_the_sidecar_on_loopback_with_the_token() -> None:
    pod = _pod_spec(_one("JobSet"))
    env = _env(_trainer(pod))
    port = _sidecar_port(pod)["containerPort"]
    assert env["CKPTD_URL"]["value"] == f"http://127.0.0.1:{port}"
    secret = _one("Secret")
    ref = env["CKPTD_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret.get("stringData", {}) | secret.get("data", {})
    assert "value" not in env["CKPTD_TOKEN"], "never a literal token in the manifest"
    # The trainer saves under the same root that ckptd serves.
    root_ref = env["CHECKPOINT_ROOT"]["valueFrom"]["configMapKeyRef"]
    assert root_ref == {"name": _one("ConfigMap")["metadata"]["name"], "key": "CKPTD_ROOT"}
    # The run's identity (docs/protocol.md, Identity) is the JobSet's name: the same across restarts, so a
    # restarted pod may resume the run's steps, and a step of another JobSet is refused.
    run_ref = env["CKPTD_RUN_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert run_ref == "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"


def test_sidecar_reads_the_token_from_the_secret_as_a_file() -> None:
    pod = _pod_spec(_one("JobSet"))
    sidecar = _sidecar(pod)
    secret = _one("Secret")
    token_file = Path(_config()["CKPTD_TOKEN_FILE"])
    mount = {m["mountPath"]: m for m in sidecar["volumeMounts"]}[str(token_file.parent)]
    assert mount.get("readOnly") is True
    volume = _only(pod["volumes"], mount["name"])["secret"]
    assert volume["secretName"] == secret["metadata"]["name"]
    (item,) = volume["items"]
    assert item["path"] == token_file.name
    assert item["key"] == _env(_trainer(pod))["CKPTD_TOKEN"]["valueFrom"]["secretKeyRef"]["key"]
    # 0440 is readable by ckptd's user only through the pod's fsGroup, which must be ckptd's group.
    mode = volume.get("defaultMode", 0o644)
    if not mode & 0o004:
        assert pod["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"]


def test_pod_uses_the_workload_identity_service_account() -> None:
    account = _one("ServiceAccount")
    gsa = account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]
    assert re.fullmatch(r"[a-z][-a-z0-9]{4,28}[a-z0-9]@[-a-zA-Z0-9_]+\.iam\.gserviceaccount\.com", gsa), gsa
    jobset = _one("JobSet")
    assert _pod_spec(jobset)["serviceAccountName"] == account["metadata"]["name"]
    assert account["metadata"]["namespace"] == jobset["metadata"]["namespace"]


def test_network_policy_admits_only_the_job_and_the_scrapers() -> None:
    """Every ingress rule is either the job's own pods (on any port: libtpu, Megascale, ckptd) or the metrics
    scrapers on ckptd's port only; no rule admits the whole cluster (an empty ``from`` or ``ports``)."""
    jobset = _one("JobSet")
    pod = _pod_spec(jobset)
    policy = _one("NetworkPolicy")["spec"]
    labels = _pod_labels(jobset)
    assert policy["podSelector"]["matchLabels"].items() <= labels.items(), "the policy must select the job's pods"
    assert policy["policyTypes"] == ["Ingress"]
    port = _sidecar_port(pod)["containerPort"]
    scrapers = []
    for rule in policy["ingress"]:
        assert rule.get("from"), f"a rule without `from` admits every pod of the cluster: {rule}"
        peers = rule["from"]
        if all(set(peer) == {"podSelector"} for peer in peers):  # pods of this namespace
            for peer in peers:
                assert peer["podSelector"]["matchLabels"].items() <= labels.items(), peer
        else:  # anything from elsewhere reaches ckptd's port and nothing else
            assert rule.get("ports") == [{"port": port, "protocol": "TCP"}], rule
            for peer in peers:
                assert peer.get("namespaceSelector", {}).get("matchLabels"), f"a peer of every namespace: {peer}"
                assert "ipBlock" not in peer, peer
            scrapers += [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for peer in peers]
    assert "gmp-system" in scrapers, "GKE managed Prometheus (podmonitoring.yaml) scrapes from gmp-system"


def test_trainer_runs_with_least_privilege() -> None:
    pod = _pod_spec(_one("JobSet"))
    trainer = _trainer(pod)
    context = trainer["securityContext"]
    assert context["runAsNonRoot"] is True and context.get("runAsUser", 1) != 0
    assert context["allowPrivilegeEscalation"] is False and not context.get("privileged", False)
    assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
    assert context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    # the read-only root leaves /tmp writable, on a bounded emptyDir
    mount = {m["mountPath"]: m for m in trainer["volumeMounts"]}["/tmp"]
    volume = _only(pod["volumes"], mount["name"])
    assert "sizeLimit" in volume["emptyDir"]


def test_no_kubernetes_api_token_is_mounted() -> None:
    assert _pod_spec(_one("JobSet"))["automountServiceAccountToken"] is False
    assert _one("ServiceAccount")["automountServiceAccountToken"] is False


def test_the_example_secret_placeholder_is_refused(tmp_path: Path) -> None:
    """The example Secret documents the shape; its value applied by mistake must not become the token."""
    placeholder = _one("Secret")["stringData"]["token"]
    token_file = tmp_path / "token"
    token_file.write_text(placeholder + "\n")
    for source in ({"token": placeholder}, {"token_file": str(token_file)}):
        with pytest.raises(ValidationError) as info:
            make_settings(tmp_path, tmp_path / "state", **source)
        assert "placeholder of deploy/k8s/secret.example.yaml" in str(info.value)


def test_podmonitoring_scrapes_the_sidecar_metrics() -> None:
    jobset = _one("JobSet")
    pod = _pod_spec(jobset)
    monitor = _one("PodMonitoring")
    assert monitor["metadata"]["namespace"] == jobset["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= _pod_labels(jobset).items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert isinstance(endpoint["port"], str), "a named port (it also gives metrics the container label)"
    assert endpoint["port"] == _sidecar_port(pod)["name"]


def test_servicemonitor_scrapes_the_sidecar_metrics_through_the_service() -> None:
    jobset = _one("JobSet")
    pod = _pod_spec(jobset)
    service = _one("Service")
    assert service["spec"]["clusterIP"] == "None", "headless: one endpoint per pod, no load balancing"
    assert service["spec"]["selector"].items() <= _pod_labels(jobset).items()
    metrics = _only(service["spec"]["ports"], "metrics")
    assert _resolve_port(_sidecar(pod), metrics["targetPort"]) == _sidecar_port(pod)["containerPort"]
    monitor = _one("ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")


def test_docs_commands_name_the_manifests_objects() -> None:
    """docs/deploy.md's Workload Identity and Secret commands must match the manifests' names."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    account = _one("ServiceAccount")["metadata"]
    assert f"[{account['namespace']}/{account['name']}]" in docs
    gsa = _one("ServiceAccount")["metadata"]["annotations"]["iam.gke.io/gcp-service-account"]
    assert gsa.split("@")[0] in docs
    secret = _one("Secret")["metadata"]
    assert f"create secret generic {secret['name']}" in docs


# ---- the Dockerfile ----------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        instruction, _, args = full.partition(" ")
        out.append((instruction.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def _final_stage() -> list[tuple[str, str]]:
    instructions = _dockerfile()
    starts = [i for i, (ins, _) in enumerate(instructions) if ins == "FROM"]
    assert starts, "no FROM"
    return instructions[starts[-1]:]


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def test_dockerfile_builds_on_python_slim_and_installs_the_project() -> None:
    instructions = _dockerfile()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for ins, a in instructions if ins == "ARG" and "=" in a}
    bases = [a.split()[0] for ins, a in instructions if ins == "FROM"]
    resolved = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], b) for b in bases]
    assert resolved and all(b == "python:3.11-slim" for b in resolved), resolved
    runs = " ".join(a for ins, a in instructions if ins == "RUN")
    # the project itself, with the server's dependencies only (no optax, no pathwaysutils: pyproject's roles)
    assert re.search(r"pip install '\.\[server\]'(\s|$)", runs), "the image installs the project's server role"
    # Everything COPY takes from the build context exists and is let through the .dockerignore.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for ins, a in instructions:
        if ins == "COPY" and not a.startswith("--from"):
            *sources, _ = a.split()
            for source in sources:
                assert (REPO / source).exists(), source
                assert f"!{source.rstrip('/')}" in {i.rstrip("/") for i in ignore}, source


def test_dockerfile_runs_ckptd_serve_as_a_non_root_user() -> None:
    stage = _final_stage()
    users = [a for ins, a in stage if ins == "USER"]
    assert users, "no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # The numeric UID the pod's securityContext declares (runAsNonRoot needs a numeric USER to check).
    sidecar = _sidecar(_pod_spec(_one("JobSet")))
    assert int(user) == sidecar["securityContext"]["runAsUser"]
    (entrypoint,) = [_exec_form(a) for ins, a in stage if ins == "ENTRYPOINT"]
    assert entrypoint == ["ckptd", "serve"]
    assert str(p.DEFAULT_PORT) in [a for ins, a in stage if ins == "EXPOSE"]
    env = " ".join(a for ins, a in stage if ins == "ENV")
    assert "CKPTD_HOST=0.0.0.0" in env and f"CKPTD_PORT={p.DEFAULT_PORT}" in env
    for name in re.findall(r"\b(CKPTD_\w+)=", env):
        assert name[len(ENV_PREFIX):].lower() in Settings.setting_fields(), name


def _healthcheck_command() -> list[str]:
    (healthcheck,) = [a for ins, a in _final_stage() if ins == "HEALTHCHECK"]
    _, _, command = healthcheck.partition("CMD ")
    return _exec_form(command) if command.startswith("[") else shlex.split(command)


def test_dockerfile_healthcheck_hits_healthz() -> None:
    assert "/healthz" in " ".join(_healthcheck_command())


# ---- the sidecar's command, run for real with the ConfigMap's settings --------------------------------


@contextlib.contextmanager
def serve_sidecar(sidecar: dict[str, Any], tmp_path: Path, port: int, **env: str) -> Iterator[tuple[str, str]]:
    """A sidecar container's command (``ckptd serve``, run as ``python -m ckptd``) with the ConfigMap's
    environment, then ``env`` (the container's own variables), pointed at a tmp root, ``port`` on 127.0.0.1
    and a token file; yields (url, token) once ``/readyz`` answers 200, and stops it after."""
    command = sidecar["command"] + sidecar.get("args", [])
    assert command[0] == "ckptd"
    token = "deploy-test-token"
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "root").mkdir()
    full_env = clean_env(**(_config() | env))
    full_env.update(CKPTD_ROOT=str(tmp_path / "root"), CKPTD_HOST="127.0.0.1", CKPTD_PORT=str(port),
                    CKPTD_STATE_DIR=str(tmp_path / "state"), CKPTD_TOKEN_FILE=str(tmp_path / "token"))
    proc = subprocess.Popen([sys.executable, "-m", *command], env=full_env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"{shlex.join(command)} exited with {proc.returncode}:\n{out[-3000:]}")
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout=20, interval=0.1, what=f"{shlex.join(command)}: GET /readyz -> 200")
        yield url, token
    finally:
        if not stop_process(proc, 15):
            pytest.fail("ckptd serve did not stop within 15 s of SIGTERM")


@pytest.fixture
def served_with_configmap(tmp_path: Path, tcp_port: int) -> Iterator[tuple[str, str]]:
    """The JobSet sidecar served with the ConfigMap's settings; yields (url, token)."""
    with serve_sidecar(_sidecar(_pod_spec(_one("JobSet"))), tmp_path, tcp_port) as served:
        yield served


def test_sidecar_command_starts_and_serves_with_the_configmap(
    served_with_configmap: tuple[str, str], tcp_port: int, ) -> None:
    url, token = served_with_configmap
    assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    metrics = httpx.get(f"{url}/metrics", timeout=5)
    assert metrics.status_code == 200 and "text/plain" in metrics.headers["content-type"]
    # The token came from CKPTD_TOKEN_FILE.
    assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 401
    assert httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code == 200
    # The image's HEALTHCHECK command passes against a serving ckptd.
    check = _healthcheck_command()
    assert check[0] == "python"
    done = subprocess.run([sys.executable, *check[1:]], env=clean_env(CKPTD_PORT=str(tcp_port)),
                          capture_output=True, text=True, timeout=15, check=False)
    assert done.returncode == 0, done.stderr


# ---- CKPTD_TOKEN_FILE ---------------------------------------------------------------------------------


def test_token_file_turns_on_auth(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret-from-file \n")
    (tmp_path / "root").mkdir()
    settings = make_settings(tmp_path / "root", tmp_path / "state", token_file=str(token_file))
    assert settings.auth.token == "s3cret-from-file"
    with TestClient(create_app(settings, background=False)) as client:
        assert client.get("/v1/jobs").status_code == 401
        assert client.get("/v1/jobs", headers={"Authorization": "Bearer s3cret-from-file"}).status_code != 401
        assert client.get("/healthz").status_code == 200


def test_token_file_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("env-token\n")
    monkeypatch.delenv("CKPTD_TOKEN", raising=False)
    monkeypatch.setenv("CKPTD_TOKEN_FILE", str(token_file))
    assert Settings().auth.token == "env-token"


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "cannot read the token file"), ("", "is empty"), (" \n\t", "is empty"), (b"\xff\xfe", "cannot read")],
    ids=["missing", "empty", "blank", "not-utf8"],
)
def test_unusable_token_file_is_a_clear_error(
    tmp_path: Path, content: str | bytes | None, expected: str,
) -> None:
    token_file = tmp_path / "token"
    if isinstance(content, bytes):
        token_file.write_bytes(content)
    elif content is not None:
        token_file.write_text(content)
    with pytest.raises(ValidationError) as info:
        make_settings(tmp_path, tmp_path / "state", token_file=str(token_file))
    assert expected in str(info.value) and str(token_file) in str(info.value)


def test_token_and_token_file_together_are_an_error(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file")
    with pytest.raises(ValidationError) as info:
        make_settings(tmp_path, tmp_path / "state", token="literal-secret", token_file=str(token_file))
    assert "not both" in str(info.value)
    assert "literal-secret" not in str(info.value), "a settings error must not print the token"


def test_serve_with_an_unreadable_token_file_exits_with_one_clear_line(
    tmp_path: Path, ) -> None:
    missing = tmp_path / "no-such-token"
    env = clean_env(CKPTD_TOKEN_FILE=str(missing), CKPTD_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--root", str(tmp_path), "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"cannot read the token file '{missing}'" in done.stderr
    assert done.stderr.startswith("ckptd: invalid settings:")

"""deploy/pathways/pathwaysjob: the Pathways deployment through Google's PathwaysJob API, checked offline.

The PathwaysJob is validated against the CRD schema of google/pathways-job v0.1.4, vendored beside the
manifest (``pathwaysjob-crd-v0.1.4.schema.json``: descriptions dropped, the pod template's properties left to
the Kubernetes schemas), made strict the way ``kubectl apply`` (server-side field validation ``Strict``)
treats the real CRD: a field the schema does not name is an error. The pod template the controller turns
into the pathways-head pod is validated as a Pod against the upstream Kubernetes JSON schemas. Then it is
held to the JobSet variant (deploy/pathways/jobset.yaml, tests/system/test_deploy_pathways.py): the same
slices, shape, elasticity, scratch location, Pathways release, trainer and ckptd, with what the controller
changes (it puts every pod on the host network) answered: ckptd on loopback, probes on loopback.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.support.helpers import REPO
from tests.system.test_deploy import K8S_VERSIONS, _env, _load, _only
from tests.system.test_deploy_pathways import (
    CKPTD,
    HEAD,
    PATHWAYS,
    PATHWAYS_IMAGES,
    PROXY,
    RM,
    TRAINER,
    WORKER,
    container,
    flags,
    image_jax_version,
    jobset,
    pod,
    replicated,
)

VARIANT = PATHWAYS / "pathwaysjob"
# What the controller (pathwaysjob_controller.go, injectJAXBackendTargetIntoMainContainer) adds to the main container.
INJECTED_ENV = {"PATHWAYS_HEAD", "JAX_PLATFORMS", "XCLOUD_ENVIRONMENT", "JAX_BACKEND_TARGET"}
# google/pathways-job's machine types (api/v1/pathwaysjob_types.go) as Pathways instance types.
INSTANCE_TYPE = {"ct5lp-hightpu-4t": "tpuv5e", "ct5p-hightpu-4t": "tpuv5", "ct6e-standard-4t": "tpuv6e",
                 "ct4p-hightpu-4t": "tpuv4", "tpu7x-standard-4t": "tpu7x"}


def pathwaysjob() -> dict[str, Any]:
    (doc,) = _load(VARIANT / "pathwaysjob.yaml")
    return doc


def crd() -> dict[str, Any]:
    vendored: dict[str, Any] = json.loads((VARIANT / "pathwaysjob-crd-v0.1.4.schema.json").read_text())
    return vendored


def strict(schema: Any) -> Any:
    """The CRD's structural schema as the API server applies it with strict field validation: an object that
    lists its properties takes no others (unless the schema preserves unknown fields there)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validator() -> jsonschema.Draft7Validator:
    schema = strict(crd()["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def template() -> dict[str, Any]:
    spec: dict[str, Any] = pathwaysjob()["spec"]["controller"]["template"]
    return spec


def as_pod(pod_template: dict[str, Any]) -> dict[str, Any]:
    metadata = {"name": "pathways-head", **pod_template.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_template["spec"]}


def test_pathwaysjob_matches_the_vendored_crd_schema() -> None:
    doc = pathwaysjob()
    vendored = crd()
    assert (doc["apiVersion"], doc["kind"]) == (vendored["apiVersion"], vendored["kind"])
    validator().validate(doc)


@pytest.mark.parametrize(
    ("path", "key"),
    [(("spec",), "elasticSlice"), (("spec", "controller"), "mainContainer"), (("spec", "workers", 0), "slices")],
    ids=["spec-typo", "controller-typo", "worker-typo"],
)
def test_crd_schema_validation_is_strict(path: tuple[str | int, ...], key: str) -> None:
    doc = pathwaysjob()
    node: Any = doc
    for part in path:
        node = node[part]
    node[key] = 1
    with pytest.raises(jsonschema.ValidationError, match=key):
        validator().validate(doc)
    bad = pathwaysjob()
    bad["spec"]["workers"][0]["type"] = "v5litepod-16"  # not a machine type the controller knows
    with pytest.raises(jsonschema.ValidationError):
        validator().validate(bad)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_head_pod_template_matches_the_kubernetes_schema(version: str) -> None:
    kubernetes_validate.validate(as_pod(template()), version, strict=True)
    broken = copy.deepcopy(template())
    _only(broken["spec"]["initContainers"], CKPTD)["startupProbe"]["httpGet"]["hots"] = "127.0.0.1"
    with pytest.raises(kubernetes_validate.ValidationError, match="hots"):
        kubernetes_validate.validate(as_pod(broken), version, strict=True)


def test_same_slices_shape_elasticity_and_release_as_the_jobset() -> None:
    spec, js = pathwaysjob()["spec"], jobset()
    head = pod(js, HEAD)
    rm, proxy = flags(container(head, RM)), flags(container(head, PROXY))
    (workers,) = spec["workers"]
    assert workers["numSlices"] == replicated(js, WORKER)["replicas"] == int(rm["instance_count"])
    assert f"{INSTANCE_TYPE[workers['type']]}:{workers['topology']}" == rm["instance_type"]
    assert spec["controller"]["elasticSlices"] == int(proxy["num_elastic_slices"])
    job = replicated(js, WORKER)["template"]["spec"]
    assert workers["maxSliceRestarts"] * job["completions"] == job["backoffLimit"], "the controller's backoffLimit"
    assert spec["pathwaysDir"] == rm["gcs_scratch_location"]
    assert spec["maxRestarts"] == js["spec"]["failurePolicy"]["maxRestarts"]
    # pathwaysVersion picks the images' tag: the JobSet's pinned Pathways release.
    (version,) = {image_jax_version(container(head, n)["image"]) for n in (RM, PROXY)}
    assert spec["pathwaysVersion"] == f"jax-{version}"
    assert container(head, RM)["image"] == f"{PATHWAYS_IMAGES}server:{spec['pathwaysVersion']}"
    assert spec["controller"]["deploymentMode"] == "default", "the head on a CPU node, the TPUs for the workers"


def test_head_template_is_the_jobsets_head_minus_what_the_controller_adds() -> None:
    """The trainer and ckptd of the JobSet's head, the main container named for the controller, and none of
    the variables the controller injects (a second definition would shadow them)."""
    spec = template()["spec"]
    js_head = pod(jobset(), HEAD)
    assert pathwaysjob()["spec"]["controller"]["mainContainerName"] == TRAINER
    assert [c["name"] for c in spec["containers"]] == [TRAINER]
    # The controller appends its resource manager and proxy to these.
    assert [c["name"] for c in spec["initContainers"]] == [CKPTD]
    trainer = container(spec, TRAINER)
    assert not INJECTED_ENV & set(_env(trainer))
    js_trainer = container(js_head, TRAINER)
    assert {k: v for k, v in _env(js_trainer).items() if k not in INJECTED_ENV} == _env(trainer)
    for key in set(trainer) | set(js_trainer):
        if key != "env":
            assert trainer.get(key) == js_trainer.get(key), key
    for key in set(spec) | set(js_head):
        if key not in ("containers", "initContainers"):
            assert spec.get(key) == js_head.get(key), key


def test_ckptd_binds_loopback_on_the_controllers_host_network() -> None:
    """The controller sets hostNetwork on the head pod, so 0.0.0.0 would be every interface of the node: ckptd
    listens on 127.0.0.1 and the kubelet (on the host network too) probes 127.0.0.1. Everything else is the
    JobSet variant's ckptd."""
    ckptd, js_ckptd = container(template()["spec"], CKPTD), container(pod(jobset(), HEAD), CKPTD)
    assert _env(ckptd)["CKPTD_HOST"]["value"] == "127.0.0.1"
    assert {k: v for k, v in _env(ckptd).items() if k != "CKPTD_HOST"} == _env(js_ckptd)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        loopback = copy.deepcopy(js_ckptd[probe])
        loopback["httpGet"]["host"] = "127.0.0.1"
        assert ckptd[probe] == loopback, probe
    for key in set(ckptd) | set(js_ckptd):
        if key not in ("env", "startupProbe", "readinessProbe", "livenessProbe"):
            assert ckptd.get(key) == js_ckptd.get(key), key


def test_docs_install_the_controller_release_the_schema_comes_from() -> None:
    docs = (REPO / "docs" / "deploy.md").read_text()
    vendored = crd()
    assert f"pathways-job/releases/download/{vendored['release']}/install.yaml" in docs
    assert f"releases/download/{vendored['release']}/install.yaml" in (VARIANT / "pathwaysjob.yaml").read_text()
    commit = re.search(r"/blob/([0-9a-f]{7})", vendored["source"])
    assert commit and commit.group(1) in docs, "docs/deploy.md cites the commit the schema comes from"

"""The monitoring ckptd ships, checked against what a real ``ckptd serve`` exports at ``GET /metrics``.

- No metric of ckptd carries a label that Prometheus sets on the series it scrapes (``job``, ``instance``,
  and those the shipped PodMonitoring and ServiceMonitor add): such a label would be renamed
  ``exported_<name>`` and every query naming it would find nothing. The training job is ``ckpt_job``.
- The process metrics a sidecar's limits are sized from are there (``process_*``, threads, the persist
  worker's memory and CPU), with the values /proc gives for that very process.
- The alerting rules (deploy/k8s/rules.yaml for GKE managed Prometheus, deploy/k8s/prometheusrule.yaml for
  prometheus-operator) match strict schemas written from the upstream API types, carry the same groups, and
  are the alerts docs/operations.md lists; the Grafana dashboard (deploy/monitoring/) is well formed.
- Every expression of every alert and every dashboard query parses as PromQL (``promql-parser``, the
  Prometheus grammar in Rust) and names only metrics and labels that the scraped ckptd exposes (or the
  Kubernetes target labels the shipped monitors attach, such as ``pod``; never the scrape's ``job`` or
  ``instance``); ``rate``/``increase`` only read counters and histograms.

The server is a real ``ckptd serve`` subprocess over a root with a plain-Orbax job, its stored events, a
lease, a step committed and one found bad while it runs, and a resume request: every ckptd family has samples.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ckptd._metrics import JOB_LABEL
from ckptd._process_metrics import ProcessTreeCollector
from ckptd.events._events import EventStore
from tests.support.helpers import REPO, clean_env, free_port, stop_process, wait_until
from tests.support.orbax_steps import training_metadata, write_orbax_steps
from trainer_client.core import protocol as p
from trainer_client.core._storage import Storage

pytestmark = pytest.mark.integration

K8S = REPO / "deploy" / "k8s"
RULE_FILES = {"Rules": K8S / "rules.yaml", "PrometheusRule": K8S / "prometheusrule.yaml"}
DASHBOARD = REPO / "deploy" / "monitoring" / "ckptd-dashboard.json"
JOB = "llm"
T0 = 1_700_000_000.0
# Set by Prometheus on every series it scrapes, whatever the scrape config.
PROMETHEUS_LABELS = {"job", "instance"}
# GKE managed Prometheus adds these to every series (prometheus-engine's target labels).
GMP_LABELS = {"project_id", "location", "cluster", "namespace"}
# prometheus-operator adds these for a ServiceMonitor target.
OPERATOR_LABELS = {"namespace", "service", "pod", "container", "endpoint"}
RATED = {"rate", "irate", "increase"}  # functions that only make sense on counters


# ---- a real ckptd serve, scraped ----------------------------------------------------------------------


@dataclass
class Scrape:
    pid: int
    text: str
    types: dict[str, str] = field(default_factory=dict)  # sample name -> its family's type
    labels: dict[str, set[str]] = field(default_factory=dict)  # sample name -> label names of its samples
    values: dict[str, float] = field(default_factory=dict)  # sample name (unlabelled samples only) -> value

    def __post_init__(self) -> None:
        for family in text_string_to_metric_families(self.text):
            for sample in family.samples:
                self.types[sample.name] = family.type
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                if not sample.labels:
                    self.values[sample.name] = sample.value


def _event(i: int, kind: str, **fields: Any) -> p.ElasticEvent:
    return p.ElasticEvent(kind=kind, time=T0 + i, run="r", id=f"{kind}-{i}", **fields)


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def _job_values(text: str) -> dict[str, float]:
    """The samples of job ``JOB`` with no other label, by name (whatever the job's label is called)."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if list(s.labels.values()) == [JOB]}


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    tmp = tmp_path_factory.mktemp("monitoring")
    root, job = tmp / "root", tmp / "root" / JOB
    write_orbax_steps(job, [10, 20], custom_metadata={s: training_metadata(s) for s in (10, 20)})
    EventStore(Storage(str(root))).append(JOB, [  # a history a previous ckptd stored
        _event(0, "start"), _event(10, "checkpoint_started", step=10, blocked_seconds=0.5),
        _event(20, "recovered", recovery_seconds=30.0, lost_steps=4, restored_from="replicas"),
        _event(30, "finished", step=20)])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the peer channel on (its numbers are read at each scrape): a shared-memory directory and a secret
    env = clean_env(CKPTD_REFRESH_INTERVAL_S="0.2", CKPTD_LEASE_TTL_S="10", CKPTD_PEER_PORT=str(free_port()),
                    CKPTD_PEER_SECRET="monitoring-test-secret")
    with (tmp / "serve.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--port", str(port),
                                 "--state-dir", str(tmp / "state"), "--shm-dir", str(tmp / "shm")], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp / "serve.log").read_text()
            try:
                return httpx.get(f"{url}{p.ROUTE_READYZ}", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=60, what="ckptd serve to be ready")
        wait_until(lambda: "ckptd_goodput_ratio{" in _metrics(url), timeout=30, what="the first metrics pass")
        wait_until(lambda: httpx.post(f"{url}/v1/jobs/{JOB}/resume", json={"alive_devices": 8}, timeout=30)
                   .status_code == 200, timeout=30, interval=0.2, what="a resume plan (once steps are verified)")
        # A trainer reports a save with its replica snapshot tier's counters (they are gauges of the live run).
        replica = {"replica_held_step": 20, "replica_age_seconds": 0.4, "replica_skips": 2, "replica_failures": 1,
                   "replica_bytes_held": 4096, "replica_period": 26, "replica_memory_kind": "pinned_host",
                   "replica_copy_seconds": 5.6, "replica_copy_bytes_per_second": 0.93e9, "replica_overhead": 0.004,
                   "replica_expected_lost_steps": 33.5}
        live = _event(40, "checkpoint_started", step=20, blocked_seconds=0.1, **replica).model_dump(exclude_none=True)
        # and its autopilot's decision (the chosen periods, the estimated MTBF and the expected goodput are gauges)
        decided = _event(41, "autopilot_decided", step=20, autopilot_changed=True, autopilot_reason="the first choice",
                         autopilot_goodput_after=0.97, autopilot_mtbf_s=14400.0, autopilot_mtbf_source="prior",
                         autopilot_failures_seen=0, autopilot_replicas_period=26, autopilot_memory_period=300,
                         autopilot_storage_period=900).model_dump(exclude_none=True)
        assert httpx.post(f"{url}/v1/jobs/{JOB}/events", json={"events": [live, decided]},
                          timeout=30).status_code == 200
        # Seen while running: a good step committed (a copy without ckptd's files), a bad one (a truncated file).
        shutil.copytree(job / "20", job / "30", ignore=shutil.ignore_patterns("ckptd_*"))
        shutil.copytree(job / "20", job / "40")
        data = next((job / "40" / "default" / "ocdbt.process_0" / "d").iterdir())
        data.write_bytes(data.read_bytes()[:-1])

        def tracked() -> bool:
            values = _job_values(_metrics(url))
            return values.get("ckptd_commits_total") == 2 and values.get("ckptd_validation_failures_total") == 1

        wait_until(tracked, timeout=30, what="the commit of step 30 and the failure of step 40 in the metrics")
        yield Scrape(proc.pid, _metrics(url))
    finally:
        assert stop_process(proc, 15)


# ---- labels, and the process metrics ------------------------------------------------------------------


def _monitor_target_labels() -> set[str]:
    """The labels the shipped PodMonitoring and ServiceMonitor add to every series they scrape."""
    (podmonitoring,) = yaml.safe_load_all((K8S / "podmonitoring.yaml").read_text())
    (servicemonitor,) = yaml.safe_load_all((K8S / "servicemonitor.yaml").read_text())
    target = podmonitoring["spec"]["targetLabels"]
    labels = set(target.get("metadata", [])) | {m.get("to", m["from"]) for m in target.get("fromPod", [])}
    labels |= {re.sub(r"[^a-zA-Z0-9_]", "_", name) for name in servicemonitor["spec"].get("podTargetLabels", [])}
    return labels | PROMETHEUS_LABELS | GMP_LABELS | OPERATOR_LABELS


def test_no_metric_label_collides_with_a_label_prometheus_sets(scrape: Scrape) -> None:
    exported = set().union(*scrape.labels.values())
    assert not exported & _monitor_target_labels(), "renamed exported_<label> by Prometheus: queries miss it"
    per_job = {name for name, labels in scrape.labels.items() if JOB_LABEL in labels}
    assert {"ckptd_latest_good_step", "ckptd_steps", "ckptd_commits_total", "ckptd_goodput_ratio",
            "ckptd_lease_leader", "ckptd_recovery_seconds_bucket"} <= per_job


def _proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def test_the_process_metrics_a_sidecar_is_sized_from_are_exported(scrape: Scrape) -> None:
    v = scrape.values
    for name in ("process_resident_memory_bytes", "process_virtual_memory_bytes", "process_cpu_seconds_total",
                 "process_open_fds", "process_max_fds", "process_start_time_seconds", "ckptd_process_threads",
                 "ckptd_child_processes", "ckptd_child_resident_memory_bytes", "ckptd_child_cpu_seconds_total"):
        assert name in v, f"{name} is not exported"
    status = _proc_status(scrape.pid)  # the server is still running: the same process, a moment later
    rss_kib = int(status["VmRSS"].split()[0])
    assert 0.5 < v["process_resident_memory_bytes"] / (rss_kib * 1024) < 2.0
    assert v["ckptd_process_threads"] >= 2 and abs(v["ckptd_process_threads"] - int(status["Threads"])) <= 8
    assert 0 < v["process_open_fds"] < v["process_max_fds"]
    assert v["process_cpu_seconds_total"] > 0


def test_the_children_of_ckptd_are_counted_live_and_after_they_exit() -> None:
    """A real child allocating 64 MiB and burning CPU: counted while it lives; after it exits and is reaped
    its CPU stays in the counter (which never goes down) and its memory leaves the gauge."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nx = bytearray(64 << 20)\n"
                              "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
                              "print('ready', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    collector = ProcessTreeCollector()

    def values() -> dict[str, float]:
        return {s.name: s.value for family in collector.collect() for s in family.samples}

    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        live = values()
        assert live["ckptd_child_processes"] >= 1
        assert live["ckptd_child_resident_memory_bytes"] >= 64 << 20
        assert live["ckptd_child_cpu_seconds_total"] >= 0.25
    finally:
        child.communicate(timeout=30)
    after = values()
    assert after["ckptd_child_processes"] == live["ckptd_child_processes"] - 1
    assert after["ckptd_child_resident_memory_bytes"] <= live["ckptd_child_resident_memory_bytes"] - (64 << 20)
    assert after["ckptd_child_cpu_seconds_total"] >= live["ckptd_child_cpu_seconds_total"]


# ---- the rule objects: schemas, the two agree, the docs list them -------------------------------------


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STR = {"type": "string"}
_STR_MAP = {"type": "object", "additionalProperties": _STR}
_DURATION = {"type": "string", "pattern": r"^((\d+)y)?((\d+)w)?((\d+)d)?((\d+)h)?((\d+)m)?((\d+)s)?((\d+)ms)?$",
             "minLength": 2}
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_METADATA = _obj({"name": _NAME, "namespace": _NAME, "labels": _STR_MAP, "annotations": _STR_MAP}, ("name",))


def _rules_schema(api_version: str, kind: str, rule: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    an_alert = {"oneOf": [{"required": ["alert"], "not": {"required": ["record"]}},
                          {"required": ["record"], "not": {"anyOf": [{"required": ["alert"]},
                                                                      {"required": ["annotations"]},
                                                                      {"required": ["for"]}]}}]}
    rules = {"type": "array", "minItems": 1, "items": {**_obj(rule, ("expr",)), **an_alert}}
    groups = {"type": "array", "minItems": 1, "items": _obj({**group, "name": _STR, "interval": _DURATION,
                                                              "rules": rules}, ("name", "rules"))}
    return _obj({"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _METADATA,
                 "spec": _obj({"groups": groups}, ("groups",))}, ("apiVersion", "kind", "metadata", "spec"))


_RULE = {"record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
         "alert": {"type": "string", "pattern": r"^[A-Za-z][A-Za-z0-9_]*$"},
         "expr": {"type": "string", "minLength": 1}, "for": _DURATION, "labels": _STR_MAP, "annotations": _STR_MAP}
# monitoring.googleapis.com/v1 Rules (prometheus-engine pkg/operator/apis/monitoring/v1/rules_types.go):
# RulesSpec{groups}, RuleGroup{name, interval, rules}, Rule{record|alert, expr, for, labels, annotations}.
RULES_SCHEMA = _rules_schema("monitoring.googleapis.com/v1", "Rules", _RULE, {})
# monitoring.coreos.com/v1 PrometheusRule (prometheus-operator pkg/apis/monitoring/v1/prometheusrule_types.go).
PROMETHEUSRULE_SCHEMA = _rules_schema(
    "monitoring.coreos.com/v1", "PrometheusRule", {**_RULE, "keep_firing_for": _DURATION},
    {"labels": _STR_MAP, "limit": {"type": "integer", "minimum": 0}, "query_offset": _DURATION,
     "partial_response_strategy": {"enum": ["abort", "warn", ""]}})
SCHEMAS = {"Rules": RULES_SCHEMA, "PrometheusRule": PROMETHEUSRULE_SCHEMA}


def _rule_object(kind: str) -> dict[str, Any]:
    (doc,) = yaml.safe_load_all(RULE_FILES[kind].read_text())
    assert isinstance(doc, dict)
    return doc


def _alerts() -> list[dict[str, Any]]:
    return [rule for group in _rule_object("Rules")["spec"]["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_the_rule_objects_match_their_schema(kind: str) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMAS[kind])
    jsonschema.Draft202012Validator(SCHEMAS[kind]).validate(_rule_object(kind))
    assert _rule_object(kind)["metadata"]["namespace"] == "training"


@pytest.mark.parametrize(("where", "value"), [("alrt", "X"), ("for", "10 minutes"), ("record", "a")])
def test_the_rule_schemas_are_strict(where: str, value: str) -> None:
    for kind, schema in SCHEMAS.items():
        doc = _rule_object(kind)
        doc["spec"]["groups"][0]["rules"][0][where] = value  # a typo, a bad duration, an alert that records
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)


def test_both_rule_objects_carry_the_same_alerts_and_the_docs_list_them() -> None:
    assert _rule_object("Rules")["spec"] == _rule_object("PrometheusRule")["spec"]
    alerts = _alerts()
    assert len({a["alert"] for a in alerts}) == len(alerts) >= 8
    docs = (REPO / "docs" / "operations.md").read_text()
    for alert in alerts:
        assert alert["alert"] in docs and alert["expr"] in docs, f"docs/operations.md: {alert['alert']}"
        assert alert["labels"]["severity"] in {"critical", "warning"}
        assert {"summary", "description"} <= alert["annotations"].keys()
    for name in ("operations.md", "deploy.md", "protocol.md"):  # the old label, in queries or the exposition
        text = (REPO / "docs" / name).read_text()
        assert not re.search(r"by \((exported_)?job\b|\{(exported_)?job=|ckptd_\w+\{(exported_)?job\b", text), name


# ---- every query against the scrape -------------------------------------------------------------------


@dataclass
class References:
    metrics: set[str] = field(default_factory=set)
    selected: set[tuple[str, str]] = field(default_factory=set)  # (metric, label) of a label matcher
    grouped: set[str] = field(default_factory=set)  # labels of by/without/on/ignoring/group_left/group_right
    rated: set[str] = field(default_factory=set)  # metrics read by rate/irate/increase


def _references(expr: str) -> References:
    refs = References()

    def visit(node: Any) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            refs.metrics.add(node.name)
            refs.selected |= {(node.name, m.name) for m in node.matchers.matchers}
        elif kind == "AggregateExpr" and node.modifier is not None:
            refs.grouped |= set(node.modifier.labels)
        elif kind == "BinaryExpr" and node.modifier is not None:
            refs.grouped |= set(node.modifier.matching.labels if node.modifier.matching else [])
            refs.grouped |= set(node.modifier.group_labels or [])
        elif kind == "Call" and node.func.name in RATED:
            refs.rated |= {arg.vector_selector.name for arg in node.args if type(arg).__name__ == "MatrixSelector"}

    promql_parser.walk(promql_parser.parse(expr), visit)
    assert refs.metrics, f"{expr!r} reads no metric"
    return refs


def _problems(expr: str, scrape: Scrape, also: frozenset[str] = frozenset()) -> list[str]:
    """What in ``expr`` a scrape of ckptd does not back: metrics, labels, rates of gauges."""
    refs = _references(expr)
    targets = _monitor_target_labels() - PROMETHEUS_LABELS  # the scrape job is never what a ckptd query wants
    problems = [f"no metric {m}" for m in sorted(refs.metrics - scrape.labels.keys())]
    problems += [f"{m} has no label {label}" for m, label in sorted(refs.selected)
                 if m in scrape.labels and label not in scrape.labels[m] | targets]
    exported = set().union(*(scrape.labels.get(m, set()) for m in refs.metrics))
    problems += [f"no metric here has the label {label}" for label in sorted(refs.grouped - exported - targets)]
    problems += [f"rate of the {scrape.types[m]} {m}" for m in sorted(refs.rated)
                 if m in scrape.types and not ((scrape.types[m] == "counter" and m.endswith("_total"))
                                               or scrape.types[m] == "histogram")]
    problems += [f"the alert's text names the label {label}" for label in sorted(also - refs.grouped - exported
                                                                                 - targets)]
    return problems


def test_every_alert_reads_what_a_running_ckptd_exports(scrape: Scrape) -> None:
    problems = []
    for alert in _alerts():
        text = json.dumps(alert["annotations"])
        named = frozenset(re.findall(r"\$labels\.(\w+)", text))
        problems += [f"{alert['alert']}: {p}" for p in _problems(alert["expr"], scrape, named)]
    assert not problems, "\n".join(problems)


def test_the_expression_checks_catch_what_they_should(scrape: Scrape) -> None:
    """The old alerts (label ``job``), a misspelt metric, a rate of a gauge and broken PromQL all fail."""
    assert _problems('max by (job) (increase(ckptd_commits_total[1h])) == 0', scrape) == [
        "no metric here has the label job"]
    assert _problems('absent(ckptd_latest_good_step{exported_job="llm-train"})', scrape) == [
        "ckptd_latest_good_step has no label exported_job"]
    assert _problems("ckptd_latest_good_steps", scrape) == ["no metric ckptd_latest_good_steps"]
    assert _problems("rate(ckptd_goodput_ratio[5m])", scrape) == ["rate of the gauge ckptd_goodput_ratio"]
    with pytest.raises(ValueError):
        _references("max by (ckpt_job) (ckptd_steps > 0")


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _grafana(expr: str) -> str:
    """A Grafana query as Prometheus gets it: ``$__rate_interval`` a duration, ``$ckpt_job`` a regex."""
    return re.sub(r"\$\{?\w+\}?", ".*", re.sub(r"\$__\w+", "5m", expr))


def test_the_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "ckptd" and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat", "gauge", "table"} and panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_every_dashboard_query_reads_what_a_running_ckptd_exports(scrape: Scrape) -> None:
    dashboard = _dashboard()
    queries = {f"{panel['title']} {t['refId']}": t["expr"] for panel in dashboard["panels"]
               for t in panel.get("targets", [])}
    shown = {name for expr in queries.values() for name in _references(_grafana(expr)).metrics}
    problems = [f"{where}: {p}" for where, expr in queries.items() for p in _problems(_grafana(expr), scrape)]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variable["query"]["query"])
            assert found, variable["query"]
            metric, label = found.groups()
            if label not in scrape.labels.get(metric, set()):
                problems.append(f"variable {variable['name']}: {metric} has no label {label}")
    assert not problems, "\n".join(problems)
    ckptd_families = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in scrape.labels
                      if name.startswith("ckptd_") and not name.endswith("_created")}
    missing = {f for f in ckptd_families if not any(re.sub(r"_(bucket|sum|count|total)$", "", s) == f for s in shown)}
    assert not missing, f"ckptd metrics no panel shows: {sorted(missing)}"

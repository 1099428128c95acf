"""The Helm chart (deploy/helm/kvserve), rendered offline by Helm's own library (helm-python-sdk; no cluster runs
here): every core object valid for Kubernetes (kubernetes-validate, strict), the InferencePool, HTTPRoute and
ServiceMonitor valid against the schemas of their CRDs (vendored in tests/deploy/crds), the node pod the stack that
`kvserve compose` describes for one node (computed here from launcher/topology.py and launcher/compose.py), the
EPP's fleet file, the InferencePool and the route wired to what the chart runs, and bad values refused by name."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from contracts.expert_parallel import COMPOSE_RENDEZVOUS_PORT
from launcher.compose import compose_config, compose_document, compose_topology
from launcher.topology import COMPOSE_CONFIG_PATH, ServiceSpec, rank_name

try:
    import helm_python as helm
except ImportError:
    pytest.skip("helm-python-sdk is not installed (pip install -e '.[test]')", allow_module_level=True)
except Exception as exc:  # HelmLibraryError: installed, but its native library does not load on this machine
    pytest.skip(f"helm-python-sdk's library does not load here: {exc}", allow_module_level=True)
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvserve"
CRDS = Path(__file__).resolve().parent / "crds"
COMPOSE_YAML = ROOT / "config" / "compose.yaml"
RELEASE = "kvserve"
NAMESPACE = "serving"
# The oldest Kubernetes the chart's kubeVersion admits (sidecar containers on by default) and the newest the
# pinned kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
CORE_API_VERSIONS = {"v1", "apps/v1", "networking.k8s.io/v1"}
CRD_FILES = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}
SECRET_KEYS = {  # compose's secret name (the file under /run/secrets) -> the key in the chart's Secret
    "kvserve_internal_secret": "internal-secret",
    "kvserve_redis_password": "redis-password",
    "kvserve_api_keys": "api-keys.json",
}
GIVEN_KEYS = {
    "existingSecret": "",
    "internalSecret": "s" * 43,
    "redisPassword": "redis-password-here",
    "apiKeys": '{"keys": []}',
    "metricsApiKey": "kvs-metrics-key",
}
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "2 nodes x 4 GPUs": {"nodes": 2, "gpusPerNode": 4, "serviceMonitor": {"enabled": True}},
    "expert parallel": {
        "gpusPerNode": 8,
        "expertParallel": 4,
        "model": "/models/DeepSeek-V2-Lite",
        "modelVolume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        "l1SizeGb": 100.5,
    },
    "given keys": {
        "secrets": GIVEN_KEYS,
        "redis": {"persistence": {"enabled": True}},
        "serviceMonitor": {"enabled": True},
    },
    "existing secret": {"secrets": {"existingSecret": "team-kvserve-keys"}, "kvEvents": {"enabled": False}},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders for `values` (as `helm template` would)."""
    manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects.extend(document for document in yaml.safe_load_all(text) if document)
    return objects


def only(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} rendered"
    return found[0]


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return only(objects, "StatefulSet")["spec"]["template"]["spec"]


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def containers_by_name(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {container["name"]: container for container in all_containers(pod_spec(objects))}


def pod_labels(objects: list[dict[str, Any]], kind: str) -> dict[str, str]:
    return only(objects, kind)["spec"]["template"]["metadata"]["labels"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {variable["name"]: variable["value"] for variable in container.get("env", [])}


def metrics_ports(objects: list[dict[str, Any]]) -> set[int]:
    """The /metrics port of every node service that serves one apart from its own (kvstore, router, ranks)."""
    return {
        int(value)
        for container in all_containers(pod_spec(objects))
        for name, value in env_of(container).items()
        if name.endswith("_METRICS_PORT")
    }


def config_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(only(objects, "ConfigMap", f"{RELEASE}-node-config")["data"]["config.yaml"])


def fleet_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(only(objects, "ConfigMap", f"{RELEASE}-epp-fleet")["data"]["fleet.yaml"])


# --- the objects are what Kubernetes and the CRDs accept ---


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_core_object_is_valid_kubernetes(chart: Any, case: str, version: str) -> None:
    objects = render(chart, CASES[case])
    core = [o for o in objects if o["apiVersion"] in CORE_API_VERSIONS]
    assert {o["kind"] for o in core} >= {"StatefulSet", "Service", "ConfigMap", "Deployment"}
    assert all(o["apiVersion"] in CORE_API_VERSIONS or (o["apiVersion"], o["kind"]) in CRD_FILES for o in objects)
    for obj in core:
        kubernetes_validate.validate(obj, version, strict=True)


def strict_schema(schema: Any) -> Any:
    """A CRD's schema as the API server's strict field validation reads it: an unknown field is an error (the
    server would prune it, or refuse it under kubectl's --validate=strict), not something jsonschema lets by."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_schema(value) for key, value in schema.items()}
    open_object = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not open_object:
        strict["additionalProperties"] = False
    return strict


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((CRDS / CRD_FILES[(api_version, kind)]).read_text())
    version = api_version.split("/")[1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return jsonschema.Draft7Validator(strict_schema(served["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("case", CASES)
def test_custom_objects_match_their_crds(chart: Any, case: str) -> None:
    values = chart.merge_values(CASES[case])
    objects = render(chart, CASES[case])
    custom = [o for o in objects if (o["apiVersion"], o["kind"]) in CRD_FILES]
    expected = {"InferencePool", "HTTPRoute"} | ({"ServiceMonitor"} if values["serviceMonitor"]["enabled"] else set())
    assert sorted(o["kind"] for o in custom) == sorted(expected)
    for obj in custom:
        errors = [error.message for error in crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj)]
        assert not errors, f"{obj['kind']}: {errors}"
    # The CEL rules (x-kubernetes-validations) that concern these objects, which only an API server evaluates.
    pool = only(objects, "InferencePool")["spec"]
    assert pool["endpointPickerRef"].get("kind", "Service") != "Service" or "port" in pool["endpointPickerRef"]
    ports = [port["number"] for port in pool["targetPorts"]]
    assert len(ports) == len(set(ports))
    for rule in only(objects, "HTTPRoute")["spec"]["rules"]:
        for backend in rule["backendRefs"]:
            assert backend.get("group", "") != "" or backend.get("kind") != "Service" or "port" in backend


@pytest.mark.parametrize(
    ("kind", "broken"),
    [
        pytest.param(
            "StatefulSet",
            lambda o: o["spec"]["template"]["spec"]["containers"][0].update(comand=["x"]),
            id="container with an unknown field",
        ),
        pytest.param("Service", lambda o: o["spec"]["ports"][0].update(port="eighty"), id="port not a number"),
        pytest.param("InferencePool", lambda o: o["spec"].pop("targetPorts"), id="pool without targetPorts"),
        pytest.param(
            "InferencePool",
            lambda o: o["spec"]["endpointPickerRef"].update(portNumber=9002),
            id="picker with an unknown field",
        ),
        pytest.param(
            "HTTPRoute",
            lambda o: o["spec"]["rules"][0]["backendRefs"][0].update(weight=-1),
            id="negative backend weight",
        ),
        pytest.param(
            "ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(scheme="gopher"), id="unknown scheme"
        ),
    ],
)
def test_the_validators_refuse_a_broken_object(chart: Any, kind: str, broken: Any) -> None:
    """The checks above can fail: one wrong field in an object the chart renders is caught."""
    objects = render(chart, {"serviceMonitor": {"enabled": True}})
    obj = copy.deepcopy(only(objects, kind, f"{RELEASE}-epp" if kind == "Service" else None))
    broken(obj)
    if obj["apiVersion"] in CORE_API_VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    else:
        assert list(crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj))


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*$")  # IANA_SVC_NAME


@pytest.mark.parametrize("case", CASES)
def test_names_and_references_the_api_server_checks(chart: Any, case: str) -> None:
    """What the API server's validation adds to the schemas: name formats, unique names in a pod, mounts of
    volumes that exist, and the StatefulSet's pods matching their own selector."""
    objects = render(chart, CASES[case])
    for obj in objects:
        name = obj["metadata"]["name"]
        assert len(name) <= 63 and DNS_LABEL.match(name), name
        if obj["kind"] == "Service":
            assert SERVICE_NAME.match(name), name
            assert all(DNS_LABEL.match(port["name"]) for port in obj["spec"]["ports"])
    for workload in (only(objects, "StatefulSet"), only(objects, "Deployment")):
        template = workload["spec"]["template"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        pod = template["spec"]
        containers = all_containers(pod)
        names = [container["name"] for container in containers]
        assert len(names) == len(set(names)) and all(DNS_LABEL.match(name) for name in names)
        port_names = [port["name"] for container in containers for port in container.get("ports", [])]
        assert len(port_names) == len(set(port_names))
        assert all(len(name) <= 15 and PORT_NAME.match(name) for name in port_names), port_names
        ports = [port["containerPort"] for container in containers for port in container.get("ports", [])]
        assert len(ports) == len(set(ports)), "two containers of one pod (one network namespace) on one port"
        # one source a volume (the schema cannot say so): a value's map merged into a default's would give two
        assert all(len(volume.keys() - {"name"}) == 1 for volume in pod["volumes"]), pod["volumes"]
        volumes = {volume["name"] for volume in pod["volumes"]}
        claims = {claim["metadata"]["name"] for claim in workload["spec"].get("volumeClaimTemplates", [])}
        assert not volumes & claims
        for container in containers:
            assert {mount["name"] for mount in container.get("volumeMounts", [])} <= volumes | claims
            variables = [variable["name"] for variable in container.get("env", [])]
            assert len(variables) == len(set(variables))


def test_lint_finds_nothing_to_warn_about() -> None:
    report = helm.lint(CHART, strict=True)
    assert report["errors"] == []
    assert [message for message in report["messages"] if message["severity"] >= 2] == []


# --- the node pod is the stack `kvserve compose` describes for one node ---


class NodePlan:
    """Where the chart puts each compose service of one node: a pod is one network namespace, so rank i listens on
    rank_worker_port + i (as `kvserve up` on one machine) and every /metrics on a port of its own; the services
    reach each other on 127.0.0.1, not by service name."""

    def __init__(self, specs: list[ServiceSpec], ports: dict[str, Any]) -> None:
        self.ports = ports
        self.pod_port = {spec.name: spec.port + self.rank_index(spec) for spec in specs}
        self.metrics_port = {
            spec.name: {
                "kvstore": ports["kvstoreMetrics"],
                "router": ports["routerMetrics"],
                "rank-worker": ports["rankWorkerMetrics"] + self.rank_index(spec),
            }[spec.role]
            for spec in specs
            if spec.metrics_port
        }
        self.addresses = {spec.address: f"127.0.0.1:{self.pod_port[spec.name]}" for spec in specs}
        for spec in specs:  # an expert-parallel group's rendezvous, its first rank's container in compose
            if spec.role == "rank-worker":
                first = f"{rank_name(self.rank_index(spec))}:{COMPOSE_RENDEZVOUS_PORT}"
                self.addresses[first] = f"127.0.0.1:{ports['expertParallelRendezvous'] + self.rank_index(spec)}"

    @staticmethod
    def rank_index(spec: ServiceSpec) -> int:
        return int(spec.name.removeprefix("rank-worker-")) if spec.role == "rank-worker" else 0

    def address(self, text: str) -> str:
        """text with every compose address (service:port) replaced by the pod's."""
        for compose_address, pod_address in self.addresses.items():
            text = re.sub(rf"(?<![\w-]){re.escape(compose_address)}(?!\d)", pod_address, text)
        return text

    def environment(self, spec: ServiceSpec, compose_env: dict[str, str]) -> dict[str, Any]:
        expected: dict[str, Any] = {}
        for name, value in compose_env.items():
            if name.endswith("_METRICS_PORT"):
                expected[name] = str(self.metrics_port[spec.name])
            elif value.startswith("["):
                expected[name] = [self.address(address) for address in json.loads(value)]
            else:
                expected[name] = self.address(value)
        return expected

    def args(self, spec: ServiceSpec, compose_command: list[str]) -> list[str]:
        args = list(compose_command)
        args[args.index("--port") + 1] = str(self.pod_port[spec.name])
        return args


KV_EVENT_VARIABLES = {
    "kvstore": {"KVSERVE_KVSTORE_KV_EVENTS_ENDPOINT", "KVSERVE_KVSTORE_KV_EVENTS_REPLAY_ENDPOINT"},
    "rank-worker": {"KVSERVE_KV_EVENTS_ENDPOINT", "KVSERVE_KV_EVENTS_REPLAY_ENDPOINT"},
}


def compose_node(objects: list[dict[str, Any]], tmp_path: Path) -> tuple[list[ServiceSpec], dict[str, Any]]:
    """What `kvserve compose` renders for one node configured by the chart's own config file: its specs and
    its compose document."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_of(objects)))
    config = compose_config(config_file)
    gpus = sum(container["name"].startswith("rank-worker-") for container in pod_spec(objects)["containers"])
    specs = compose_topology(config, gpus)
    return specs, compose_document(specs, config, "./config.yaml")


@pytest.mark.parametrize("case", CASES)
def test_the_node_pod_runs_what_compose_describes_for_one_node(chart: Any, case: str, tmp_path: Path) -> None:
    values = chart.merge_values(CASES[case])
    objects = render(chart, CASES[case])
    specs, document = compose_node(objects, tmp_path)
    plan = NodePlan(specs, values["ports"])
    pod = pod_spec(objects)
    containers = {container["name"]: container for container in all_containers(pod)}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    claim_templates = only(objects, "StatefulSet")["spec"].get("volumeClaimTemplates", [])
    claims = {claim["metadata"]["name"] for claim in claim_templates}

    assert sorted(containers) == sorted(spec.name for spec in specs)
    assert len(specs) == 4 + values["gpusPerNode"]
    for spec in specs:
        service, container = document["services"][spec.name], containers[spec.name]
        assert container["image"] == service["image"]
        assert container.get("command", []) == service.get("entrypoint", [])  # "$$" is "$" to both
        assert container["args"] == plan.args(spec, service["command"])
        environment = env_of(container)
        if values["kvEvents"]["enabled"] and spec.role in KV_EVENT_VARIABLES:
            added = KV_EVENT_VARIABLES[spec.role]
            assert added <= environment.keys()
            assert all(environment[name].startswith("tcp://0.0.0.0:") for name in added)
            environment = {name: value for name, value in environment.items() if name not in added}
        if "KVSERVE_RANK_WORKERS" in environment:
            environment["KVSERVE_RANK_WORKERS"] = json.loads(environment["KVSERVE_RANK_WORKERS"])
        assert environment == plan.environment(spec, service.get("environment", {}))
        if spec.reads_config:
            assert environment["KVSERVE_CONFIG"] == COMPOSE_CONFIG_PATH

        ports = {port["containerPort"] for port in container["ports"]}
        assert plan.pod_port[spec.name] in ports
        assert spec.name not in plan.metrics_port or plan.metrics_port[spec.name] in ports

        mounts = {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}
        secrets = mounts.pop("/run/secrets")
        items = volumes[secrets["name"]]["secret"]["items"]
        assert sorted(item["path"] for item in items) == sorted(service.get("secrets", []))
        assert all(SECRET_KEYS[item["path"]] == item["key"] for item in items)
        compose_mounts = {}
        for volume in service["volumes"]:
            _source, target, *mode = volume.split(":")
            target = str(Path(target).parent) if target == COMPOSE_CONFIG_PATH else target  # the ConfigMap's folder
            compose_mounts[target] = mode == ["ro"]
        assert {path: bool(mount.get("readOnly")) for path, mount in mounts.items()} == compose_mounts
        if "/data" in mounts:
            assert mounts["/data"]["name"] in claims if values["redis"]["persistence"]["enabled"] else volumes

        gpus = container.get("resources", {}).get("limits", {}).get(values["gpuResource"])
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        assert gpus == (len(reservations) if reservations else None) == (1 if spec.gpu is not None else None)

        check_probes(spec, container, service, plan)

    arena = volumes["l1-arena"]["emptyDir"]
    assert arena["medium"] == "Memory"
    compose_size = document["volumes"]["l1-arena"]["driver_opts"]["o"].split(",")[0].removeprefix("size=")
    assert arena["sizeLimit"] == compose_size.replace("g", "Gi")
    assert (
        sum(c.get("resources", {}).get("limits", {}).get(values["gpuResource"], 0) for c in containers.values())
        == (values["gpusPerNode"])
    )
    check_start_order(specs, pod)


def check_probes(spec: ServiceSpec, container: dict[str, Any], service: dict[str, Any], plan: NodePlan) -> None:
    """The compose healthcheck's probe, in Kubernetes' terms; its start_period is the startup probe's reach."""
    startup = container["startupProbe"]
    reach = startup["periodSeconds"] * startup["failureThreshold"]
    assert spec.startup_s <= reach < spec.startup_s + startup["periodSeconds"]
    if spec.health.kind == "redis":
        shell = ["sh", "-c", service["healthcheck"]["test"][1]]  # CMD-SHELL: its text, "$$" a "$" to both
        assert startup["exec"]["command"] == shell == container["livenessProbe"]["exec"]["command"]
    elif spec.health.kind == "grpc":  # grpc.health.v1 Check of service "" on its port, as launcher.health_check
        assert startup["grpc"] == {"port": plan.pod_port[spec.name]} == container["livenessProbe"]["grpc"]
    else:  # the gateway starts beside the ranks: its compose check (/ready) becomes its readiness
        url = urlsplit(spec.health.target)
        ready = container["readinessProbe"]["httpGet"]
        assert ready == {"path": url.path, "port": plan.pod_port[spec.name]}
        assert startup["httpGet"]["path"] == container["livenessProbe"]["httpGet"]["path"] == "/health"


def check_start_order(specs: list[ServiceSpec], pod: dict[str, Any]) -> None:
    """compose's depends_on (service_healthy): the sidecars start in turn, each after the one before passed its
    startup probe; the gateway, started beside the ranks, is ready only once a rank serves."""
    sidecars = [container["name"] for container in pod["initContainers"]]
    assert all(container["restartPolicy"] == "Always" for container in pod["initContainers"])
    assert pod.get("restartPolicy", "Always") == "Always"
    for spec in specs:
        started_before = set(sidecars[: sidecars.index(spec.name)]) if spec.name in sidecars else set(sidecars)
        not_before = set(spec.depends_on) - started_before
        ranks = {s.name for s in specs if s.role == "rank-worker"}
        assert not_before == (ranks if spec.role == "gateway" else set()), spec.name


def test_the_config_file_is_config_compose_yaml_but_for_redis_address(chart: Any, tmp_path: Path) -> None:
    """With its defaults the chart configures a node as config/compose.yaml does (docker-compose.yml's file): the
    same keys, the same values, Redis on the pod's loopback instead of the service redis."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_of(render(chart, {}))))
    chart_config = compose_config(config_file).model_dump()
    compose = compose_config(COMPOSE_YAML).model_dump()
    differ = {key for key in compose if compose[key] != chart_config[key]}
    assert differ == {"redis_url"}
    assert urlsplit(chart_config["redis_url"]).hostname == "127.0.0.1"


def test_config_values_reach_the_config_file(chart: Any, tmp_path: Path) -> None:
    model = "/models/Qwen2.5-7B-Instruct"
    values = {"model": model, "l1SizeGb": 200, "expertParallel": 2, "config": {"max_num_seqs": 128}}
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_of(render(chart, values))))
    config = compose_config(config_file)
    assert (config.model, config.l1_host_gb, config.expert_parallel_size) == (model, 200, 2)
    assert config.engine.max_num_seqs == 128


def test_the_model_volume_and_the_kv_events_topic_reach_the_pods(chart: Any) -> None:
    values = {**CASES["expert parallel"], "config": {"kv_events_topic": "kv@node"}}
    objects = render(chart, values)
    (models,) = [volume for volume in pod_spec(objects)["volumes"] if volume["name"] == "models"]
    assert models == {"name": "models", **values["modelVolume"]}
    assert config_of(objects)["kv_events_topic"] == "kv@node"
    assert {source["topic"] for node in fleet_of(objects)["nodes"] for source in node["kv_events"]} == {"kv@node"}


# --- the EPP, the InferencePool, the route, the ServiceMonitor and the NetworkPolicy fit the node pods ---


def container_env_ports(container: dict[str, Any], names: set[str]) -> list[int]:
    return [int(value.rsplit(":", 1)[1]) for name, value in env_of(container).items() if name in names]


@pytest.mark.parametrize("case", CASES)
def test_the_fleet_file_names_every_node_pod(chart: Any, case: str) -> None:
    values = chart.merge_values(CASES[case])
    objects = render(chart, CASES[case])
    fleet = fleet_of(objects)
    statefulset = only(objects, "StatefulSet")
    headless = only(objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    pod = pod_spec(objects)
    containers = {container["name"]: container for container in all_containers(pod)}
    ranks = [containers[f"rank-worker-{i}"] for i in range(values["gpusPerNode"])]
    gateway_port = containers["gateway"]["ports"][0]["containerPort"]
    rank_metrics = [env_of(rank)["KVSERVE_RANK_WORKER_METRICS_PORT"] for rank in ranks]
    events = [
        *(container_env_ports(rank, KV_EVENT_VARIABLES["rank-worker"]) for rank in ranks),
        container_env_ports(containers["kvstore"], KV_EVENT_VARIABLES["kvstore"]),
    ]

    assert len(fleet["nodes"]) == statefulset["spec"]["replicas"] == values["nodes"]
    for index, node in enumerate(fleet["nodes"]):
        pod_name = f"{statefulset['metadata']['name']}-{index}"
        host = f"{pod_name}.{headless['metadata']['name']}.{NAMESPACE}.svc.{values['clusterDomain']}"
        assert node["name"] == pod_name
        assert node["endpoint"] == f"{host}:{gateway_port}"
        assert node["metrics"] == [f"http://{host}:{port}/metrics" for port in rank_metrics]
        if values["kvEvents"]["enabled"]:
            assert [(source["endpoint"], source["replay"]) for source in node["kv_events"]] == [
                (f"tcp://{host}:{publish}", f"tcp://{host}:{replay}") for publish, replay in events
            ]
        else:
            assert node["kv_events"] == [] and all(not ports for ports in events)
    assert fleet["listen"].endswith(f":{values['epp']['ports']['extProc']}")
    assert fleet["node_api_key_file"] == "/etc/kvserve-epp/keys/node-key"
    epp = only(objects, "Deployment")["spec"]["template"]["spec"]
    projected = epp["volumes"][0]["projected"]["sources"]
    assert {"key": "metrics-api-key", "path": "keys/node-key"} in projected[1]["secret"]["items"]
    assert epp["containers"][0]["volumeMounts"][0]["mountPath"] == "/etc/kvserve-epp"
    assert epp["containers"][0]["args"] == ["python", "-m", "gateway.epp", "--fleet", "/etc/kvserve-epp/fleet.yaml"]


def test_the_epp_reads_the_fleet_file(chart: Any, tmp_path: Path) -> None:
    fleet_config = pytest.importorskip("gateway.epp.fleet_config", reason="the EPP (gateway/epp) is not there yet")
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet_of(render(chart, CASES["2 nodes x 4 GPUs"]))))
    fleet = fleet_config.load_fleet(path)
    assert [node.name for node in fleet.nodes] == [f"{RELEASE}-node-0", f"{RELEASE}-node-1"]
    assert all(len(node.kv_events) == 5 for node in fleet.nodes)


@pytest.mark.parametrize("case", CASES)
def test_the_pool_and_the_route_reach_the_gateways_through_the_epp(chart: Any, case: str) -> None:
    values = chart.merge_values(CASES[case])
    objects = render(chart, CASES[case])
    pool = only(objects, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels(objects, "StatefulSet").items()
    epp_labels = pod_labels(objects, "Deployment")
    assert not pool["spec"]["selector"]["matchLabels"].items() <= epp_labels.items()
    gateway = containers_by_name(objects)["gateway"]
    assert pool["spec"]["targetPorts"] == [{"number": gateway["ports"][0]["containerPort"]}]

    picker = pool["spec"]["endpointPickerRef"]
    service = only(objects, "Service", picker["name"])
    assert service["spec"]["selector"].items() <= epp_labels.items()
    (ext_proc,) = [port for port in service["spec"]["ports"] if port["port"] == picker["port"]["number"]]
    epp = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert ext_proc["targetPort"] in [port["containerPort"] for port in epp["ports"]]
    fleet = fleet_of(objects)
    assert fleet["listen"] == f"0.0.0.0:{ext_proc['targetPort']}"
    assert epp["readinessProbe"]["grpc"]["service"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert fleet["health_listen"].endswith(f":{epp['readinessProbe']['grpc']['port']}")

    route = only(objects, "HTTPRoute")["spec"]
    assert route["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": values["httpRoute"]["gateway"]["name"]}
    ]
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_the_service_monitor_scrapes_every_metrics_port(chart: Any) -> None:
    objects = render(chart, CASES["2 nodes x 4 GPUs"])
    monitor = only(objects, "ServiceMonitor")["spec"]
    (components,) = monitor["selector"]["matchExpressions"]
    assert components["key"] == "app.kubernetes.io/component" and components["operator"] == "In"
    selected = [
        service
        for service in (o for o in objects if o["kind"] == "Service")
        if monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        and service["metadata"]["labels"][components["key"]] in components["values"]
    ]
    ports = {port["name"]: port["targetPort"] for service in selected for port in service["spec"]["ports"]}
    scraped = {endpoint["port"] for endpoint in monitor["endpoints"]}
    assert scraped <= ports.keys()
    gateway_port = containers_by_name(objects)["gateway"]["ports"][0]["containerPort"]
    epp_metrics = int(fleet_of(objects)["metrics_listen"].rsplit(":", 1)[1])
    assert {ports[name] for name in scraped} == metrics_ports(objects) | {gateway_port, epp_metrics}
    (scrape,) = [endpoint for endpoint in monitor["endpoints"] if ports[endpoint["port"]] == gateway_port]
    assert scrape["authorization"]["credentials"] == {"name": "kvserve-secrets", "key": "metrics-api-key"}


@pytest.mark.parametrize("case", ["defaults", "existing secret"])
def test_the_network_policy_admits_the_public_ports_and_the_epp_alone_to_kv_events(chart: Any, case: str) -> None:
    values = chart.merge_values(CASES[case])
    objects = render(chart, CASES[case])
    policy = only(objects, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels(objects, "StatefulSet").items()
    containers = all_containers(pod_spec(objects))
    public = metrics_ports(objects) | {values["ports"]["gateway"]}
    events = {port for c in containers for port in container_env_ports(c, set().union(*KV_EVENT_VARIABLES.values()))}

    def admitted(rule: dict[str, Any]) -> set[int]:
        return {p for port in rule["ports"] for p in range(port["port"], port.get("endPort", port["port"]) + 1)}

    anyone = [rule for rule in policy["ingress"] if "from" not in rule]
    assert set().union(*map(admitted, anyone)) == public
    restricted = [rule for rule in policy["ingress"] if "from" in rule]
    assert set().union(set(), *map(admitted, restricted)) == events
    epp_labels = pod_labels(objects, "Deployment")
    peers = [peer for rule in restricted for peer in rule["from"]]
    assert all(peer["podSelector"]["matchLabels"].items() <= epp_labels.items() for peer in peers)
    internal = {port["containerPort"] for c in containers for port in c["ports"]} - public - events
    assert internal and not internal & set().union(*map(admitted, policy["ingress"]))


# --- secrets ---


def test_given_keys_become_the_secret_every_pod_reads(chart: Any) -> None:
    objects = render(chart, CASES["given keys"])
    secret = only(objects, "Secret")
    assert secret["stringData"] == {
        "internal-secret": GIVEN_KEYS["internalSecret"],
        "redis-password": GIVEN_KEYS["redisPassword"],
        "api-keys.json": GIVEN_KEYS["apiKeys"],
        "metrics-api-key": GIVEN_KEYS["metricsApiKey"],
    }
    assert referenced_secrets(objects) == {secret["metadata"]["name"]}


@pytest.mark.parametrize(("case", "name"), [("defaults", "kvserve-secrets"), ("existing secret", "team-kvserve-keys")])
def test_an_existing_secret_is_read_not_rendered(chart: Any, case: str, name: str) -> None:
    objects = render(chart, CASES[case])
    assert not [o for o in objects if o["kind"] == "Secret"]
    assert referenced_secrets(objects) == {name}


def referenced_secrets(objects: list[dict[str, Any]]) -> set[str]:
    names = set()
    for workload in (o for o in objects if o["kind"] in ("StatefulSet", "Deployment")):
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                names.add(volume["secret"]["secretName"])
            for source in volume.get("projected", {}).get("sources", []):
                if "secret" in source:
                    names.add(source["secret"]["name"])
    return names


# --- bad values are refused with a message that names them ---


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gpusPerNode": 0}, "gpusPerNode must be a whole number of at least 1, got 0"),
        ({"gpusPerNode": 2.5}, "gpusPerNode must be a whole number of at least 1, got 2.5"),
        ({"gpusPerNode": None}, "gpusPerNode must be a whole number of at least 1"),
        ({"nodes": 0}, "nodes must be a whole number of at least 1, got 0"),
        ({"expertParallel": 0}, "expertParallel must be a whole number of at least 1"),
        ({"gpusPerNode": 4, "expertParallel": 3}, "gpusPerNode 4 does not split into expert-parallel groups of 3"),
        ({"l1SizeGb": -1}, "l1SizeGb must be a number of GB, 0 or more, got -1"),
        ({"ports": {"rankWorkerMetrics": 9461}}, "kvstore metrics and rank 0 metrics would both listen on port 9461"),
        ({"gpusPerNode": 8, "ports": {"rankKvEvents": 5547}}, "would both listen on port 5555"),
        ({"ports": {"gateway": 70000}}, "the node pod's gateway port 70000 is not a port"),
        ({"config": {"kvstore_port": 1}}, "config.kvstore_port is set by the chart"),
        ({"config": {"kv_events_endpoint": "tcp://0.0.0.0:1"}}, "config.kv_events_endpoint is set by the chart"),
        ({"epp": {"fleet": {"nodes": []}}}, "epp.fleet.nodes is set by the chart"),
        ({"secrets": {"existingSecret": ""}}, "secrets.internalSecret must be 32 or more printable characters"),
        ({"secrets": {**GIVEN_KEYS, "internalSecret": "short"}}, "secrets.internalSecret must be 32 or more"),
        ({"secrets": {**GIVEN_KEYS, "redisPassword": ""}}, "secrets.redisPassword is required"),
        ({"secrets": {**GIVEN_KEYS, "apiKeys": ""}}, "secrets.apiKeys (the gateway's key file"),
        ({"secrets": {**GIVEN_KEYS, "metricsApiKey": ""}}, "secrets.metricsApiKey (a key with the metrics scope"),
        ({"inferencePool": {"enabled": False}}, "httpRoute.enabled needs inferencePool.enabled"),
        ({"httpRoute": {"gateway": {"name": ""}}}, "httpRoute.gateway.name"),
    ],
)
def test_bad_values_fail_to_render_with_a_clear_message(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(caught.value)


def test_the_route_and_pool_can_be_left_out(chart: Any) -> None:
    objects = render(chart, {"inferencePool": {"enabled": False}, "httpRoute": {"enabled": False}})
    assert not [o for o in objects if (o["apiVersion"], o["kind"]) in CRD_FILES]
    assert only(objects, "StatefulSet") and only(objects, "Deployment")

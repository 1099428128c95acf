"""A fleet of kvserve nodes on one machine, for the fleet tests: each node a network namespace running a whole
`kvserve up` stack on the CPU (Redis, kvstore, router, one rank, the gateway on the node's address), and an edge
namespace with Envoy (gateway/epp/envoy_config.py; one fail-open, one fail-closed), the EPP and the test's client
(tests/fleet/fleet_client.py, driven over its stdin and stdout). Every process runs inside a namespace; the test
process itself only starts them, reads their files and sends signals.

Inside a namespace every port is its own, so the nodes use fixed ports (the gateway 8080, the rank's /metrics 9470,
its vLLM-format KV events 5557 and replay 5558, the kvstore's 5567) and parallel runs never collide.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from fleet_envoy import EPP_HEALTHY_STAT, envoy_args, envoy_binary, write_bootstrap
from fleet_netns import EDGE_HOST, FIRST_NODE_HOST, Namespace, Network, network

from gateway.http.auth import ALL_MODELS, METRICS_SCOPE, create_key

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GATEWAY_PORT = 8080
RANK_METRICS_PORT = 9470
KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, KVSTORE_KV_EVENTS_PORT = 5557, 5558, 5567
EPP_PORT, EPP_METRICS_PORT = 9002, 9090
ENVOY_PORTS = {"open": (8080, 9901), "closed": (8081, 9902)}  # fail mode -> (listener, admin on loopback)
NODE_READY_S = 420  # two stacks starting at once on 2 busy cores
READY_LINE = "Ctrl-C stops everything."  # what `kvserve up` prints once its gateway is ready


def process_env() -> dict[str, str]:
    """The test's environment without its KVSERVE_* (the test secrets among them: `kvserve up` makes its own),
    the checkout importable, and one torch thread per process (two nodes share two cores)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    env["OMP_NUM_THREADS"] = "1"
    return env


SPAWNED: list[subprocess.Popen[Any]] = []  # reaped once their namespaces are gone


def spawn(namespace: Namespace, args: list[str], log_path: Path, **popen: Any) -> subprocess.Popen[Any]:
    """args inside `namespace`, output to log_path. Called from the main thread only: the child is killed when the
    thread that started it ends (PR_SET_PDEATHSIG)."""
    assert threading.current_thread() is threading.main_thread()
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            namespace.exec_args(*args),
            cwd=ROOT,
            env=process_env(),
            stdout=popen.pop("stdout", log),
            stderr=log,
            **popen,
        )
    SPAWNED.append(process)
    return process


def reap_spawned() -> None:
    """Wait for every process spawn() started (all killed with their namespaces), so none is left a zombie."""
    while SPAWNED:
        process = SPAWNED.pop()
        if process.poll() is None:
            process.kill()  # only the `ip netns exec` chain's own pid: it is ours
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)


def wait_for_line(log_path: Path, text: str, process: subprocess.Popen[Any], timeout_s: float, since: int = 0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if log_path.exists() and text in log_path.read_text(errors="replace")[since:]:
            return
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} before {text!r}:\n{tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {text!r} after {timeout_s} s:\n{tail(log_path)}")
        time.sleep(0.1)


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class NamespaceClient:
    """tests/fleet/fleet_client.py inside a namespace: submit() sends it one request, a Future gets the answer."""

    def __init__(self, namespace: Namespace, log_path: Path) -> None:
        ready: Future[dict[str, Any]] = Future()
        self._pending: dict[Any, Future[dict[str, Any]]] = {"ready": ready}  # its first line says it reads
        self._lock = threading.Lock()
        self._tags = itertools.count()
        args = [sys.executable, str(HERE / "fleet_client.py")]
        self.process = spawn(namespace, args, log_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        ready.result(timeout=60)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            answer = json.loads(line)
            with self._lock:
                future = self._pending.pop(answer["tag"], None)
            if future is not None:
                future.set_result(answer)
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(RuntimeError(f"the client exited ({self.process.poll()})"))

    def submit(self, op: str, **request: Any) -> Future[dict[str, Any]]:
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            tag = next(self._tags)
            self._pending[tag] = future
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"tag": tag, "op": op, **request}) + "\n")
            self.process.stdin.flush()
        return future

    def call(self, op: str, timeout_s: float = 600, **request: Any) -> dict[str, Any]:
        return self.submit(op, **request).result(timeout=timeout_s)

    def wait_http(self, url: str, timeout_s: float = 60, **request: Any) -> dict[str, Any]:
        """GET url from inside the namespace until it answers as asked (status 200, `contains`)."""
        answer = self.submit("wait_http", url=url, timeout_s=timeout_s, **request).result(timeout=timeout_s + 30)
        assert answer["ok"], answer
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Node:
    name: str
    namespace: Namespace
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return self.namespace.address

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{GATEWAY_PORT}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def output(self) -> Path:
        return self.directory / "up.log"

    @property
    def gateway_log(self) -> Path:
        return self.directory / "state" / "logs" / "gateway.log"

    def write_config(self, keys_file: Path) -> Path:
        """config/local.yaml with the node's addresses: the gateway on the node's address (keys required there),
        internal services on the namespace's loopback, the rank's and the kvstore's KV events on the node's
        address for the EPP; small KV pools and L1 (two nodes on one CI machine)."""
        config = yaml.safe_load((ROOT / "config" / "local.yaml").read_text())
        address = self.address
        (self.directory / "l1").mkdir(parents=True, exist_ok=True)
        config.update(
            device="cpu",
            gateway_host=address,
            gateway_port=GATEWAY_PORT,
            api_keys_file=str(keys_file),
            rank_worker_metrics_port=RANK_METRICS_PORT,
            metrics_host=address,  # the EPP in the edge namespace reads the rank's load from there
            kv_events_endpoint=f"tcp://{address}:{KV_EVENTS_PORT}",
            kv_events_replay_endpoint=f"tcp://{address}:{KV_EVENTS_REPLAY_PORT}",
            kvstore_kv_events_endpoint=f"tcp://{address}:{KVSTORE_KV_EVENTS_PORT}",
            kv_events_topic=f"kv@{self.name}@smollm2",
            max_model_len=8192,
            max_num_batched_tokens=512,  # short steps: a flood's prefill does not hold a warm turn for seconds
            kv_cache_memory_gb=0.5,
            l1_host_gb=0.5,
            l1_headroom_gb=0.0,
            l1_arena_dir=str(self.directory / "l1"),
            request_timeout_secs=300,
            heartbeat_interval_secs=0.5,
        )
        path = self.directory / "config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def start(self, keys_file: Path) -> None:
        """`kvserve up` in the node's namespace; ready once wait_ready() returns."""
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.write_config(keys_file)
        kvserve = Path(sys.executable).parent / "kvserve"
        command = [str(kvserve)] if kvserve.exists() else [sys.executable, "-m", "launcher.cli"]
        command += ["up", "--config", str(config), "--state-dir", str(self.directory / "state")]
        self.process = spawn(self.namespace, [*command, "--ready-timeout", str(NODE_READY_S)], self.output)

    def wait_ready(self, client: NamespaceClient, timeout_s: float = NODE_READY_S) -> None:
        assert self.process is not None
        wait_for_line(self.output, READY_LINE, self.process, timeout_s)
        client.wait_http(f"{self.url}/ready", timeout_s=30)  # from the edge, across the bridge
        client.wait_http(f"http://{self.address}:{RANK_METRICS_PORT}/metrics", timeout_s=30, contains="vllm:")

    def kill(self) -> None:
        """The node's machine dies: SIGKILL to every process in its namespace (`kvserve up` and its services).
        Its address stays, with nothing listening: connections to it are refused."""
        self.namespace.kill_all(signal.SIGKILL)

    def served(self, request_id: str) -> bool:
        """Whether this node's gateway logged the request `request_id` (its request line: once the answer is out)."""
        return bool(self.gateway_log.exists()) and f" request id={request_id} " in self.gateway_log.read_text(
            errors="replace"
        )


@dataclass
class Envoy:
    fail_open: bool
    url: str
    admin_url: str  # loopback inside the edge namespace
    access_log: Path
    process: subprocess.Popen[bytes]


@dataclass
class Fleet:
    net: Network
    directory: Path
    nodes: list[Node]
    client: NamespaceClient
    api_key: str
    api_key_file: Path
    envoys: dict[str, Envoy] = field(default_factory=dict)
    epp: subprocess.Popen[bytes] | None = None

    @property
    def edge(self) -> Namespace:
        return self.net["edge"]

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    # --- Envoy and the EPP ---

    def start_envoy(self, mode: str) -> Envoy:
        binary = envoy_binary()
        assert binary is not None
        port, admin_port = ENVOY_PORTS[mode]
        access_log = self.directory / f"envoy-{mode}-access.log"
        config = write_bootstrap(
            self.directory / f"envoy-{mode}.yaml",
            listen=f"{self.edge.address}:{port}",
            epp=f"{self.edge.address}:{EPP_PORT}",
            gateways=[node.endpoint for node in self.nodes],
            fail_open=mode == "open",
            admin=f"127.0.0.1:{admin_port}",
            health_check_interval_s=0.25,
            access_log_path=str(access_log),
        )
        process = spawn(self.edge, envoy_args(binary, config), self.directory / f"envoy-{mode}.log")
        envoy = Envoy(
            mode == "open", f"http://{self.edge.address}:{port}", f"http://127.0.0.1:{admin_port}", access_log, process
        )
        self.envoys[mode] = envoy
        return envoy

    def wait_envoys_ready(self) -> None:
        for envoy in self.envoys.values():
            self.client.wait_http(envoy.admin_url + "/ready", timeout_s=60, contains="LIVE")

    def wait_epp_health(self, healthy: bool, timeout_s: float = 60) -> None:
        """Until every Envoy's health checks see the EPP SERVING (or not)."""
        for envoy in self.envoys.values():
            self.client.wait_http(
                envoy.admin_url + f"/stats?filter=^{re.escape(EPP_HEALTHY_STAT)}$",
                timeout_s=timeout_s,
                contains=f"{EPP_HEALTHY_STAT}: {int(healthy)}",
            )

    def write_fleet_file(self, **settings: Any) -> Path:
        fleet = {
            "listen": f"{self.edge.address}:{EPP_PORT}",
            "health_listen": "",
            "metrics_listen": f"{self.edge.address}:{EPP_METRICS_PORT}",
            "policy": "prefix",
            "refresh_secs": 0.25,
            "node_api_key_file": str(self.api_key_file),
            "nodes": [
                {
                    "name": node.name,
                    "endpoint": node.endpoint,
                    "metrics": [f"http://{node.address}:{RANK_METRICS_PORT}/metrics"],
                    "kv_events": [
                        {
                            "endpoint": f"tcp://{node.address}:{KV_EVENTS_PORT}",
                            "replay": f"tcp://{node.address}:{KV_EVENTS_REPLAY_PORT}",
                        },
                        {"endpoint": f"tcp://{node.address}:{KVSTORE_KV_EVENTS_PORT}"},
                    ],
                }
                for node in self.nodes
            ],
            **settings,
        }
        path = self.directory / "fleet.yaml"
        path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        return path

    @property
    def epp_log(self) -> Path:
        return self.directory / "epp.log"

    def start_epp(self, **settings: Any) -> None:
        """The EPP in the edge namespace, ready once every Envoy's health check sees it SERVING (a node is ready)."""
        assert self.epp is None or self.epp.poll() is not None
        fleet_file = self.write_fleet_file(**settings)
        self.epp = spawn(self.edge, [sys.executable, "-m", "gateway.epp", "--fleet", str(fleet_file)], self.epp_log)
        try:
            self.wait_epp_health(healthy=True, timeout_s=120)
        except AssertionError:
            print(tail(self.epp_log))
            raise

    def kill_epp(self) -> None:
        assert self.epp is not None
        self.epp.send_signal(signal.SIGKILL)
        self.epp.wait(timeout=10)

    def hang_epp(self, hung: bool) -> None:
        """SIGSTOP the EPP (it holds its sockets and answers nothing) or SIGCONT it."""
        assert self.epp is not None
        self.epp.send_signal(signal.SIGSTOP if hung else signal.SIGCONT)

    def epp_log_size(self) -> int:
        return self.epp_log.stat().st_size if self.epp_log.exists() else 0

    def epp_decisions(self, since: int = 0) -> list[dict[str, str]]:
        """The fields of the EPP's decision lines (`epp chose node=... reason=... session=...`) after byte `since`."""
        lines = self.epp_log.read_text(errors="replace")[since:].splitlines() if self.epp_log.exists() else []
        return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines if "epp chose " in line]

    def wait_epp_log(self, text: str, since: int = 0, timeout_s: float = 30) -> None:
        assert self.epp is not None
        wait_for_line(self.epp_log, text, self.epp, timeout_s, since)

    # --- requests, from the client inside the edge namespace ---

    def request(
        self, session: str, messages: list[dict[str, Any]], mode: str = "open", api: str = "anthropic", **options: Any
    ) -> Future[dict[str, Any]]:
        return self.client.submit(
            api,
            base_url=self.envoys[mode].url,
            api_key=self.api_key,
            session=session,
            messages=messages,
            **options,
        )

    def served_by(self, request_id: str, timeout_s: float = 30) -> str:
        """The node whose gateway logged `request_id` (the line comes once the answer is out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = [node.name for node in self.nodes if node.served(request_id)]
            if nodes:
                assert len(nodes) == 1, f"{request_id} logged by {nodes}"
                return nodes[0]
            assert time.monotonic() < deadline, f"no node logged {request_id}"
            time.sleep(0.1)


def make_api_key(directory: Path) -> tuple[Path, str, Path]:
    """One gateway key for every node: every model, and the metrics scope (the EPP reads model info with it).
    Returns the key file, the secret, and a file holding the secret (the EPP's node_api_key_file)."""
    keys_file = directory / "keys.json"
    secret = create_key(keys_file, "fleet-test", [ALL_MODELS], [METRICS_SCOPE])
    secret_file = directory / "node-api-key"
    secret_file.touch(mode=0o600)
    secret_file.write_text(secret + "\n")
    return keys_file, secret, secret_file


@contextlib.contextmanager
def fleet(directory: Path, node_names: list[str], envoy_modes: tuple[str, ...] = ("open", "closed")) -> Iterator[Fleet]:
    """The namespaces, `node_names` nodes started in parallel, the client and the Envoys in the edge namespace;
    every process killed and every namespace removed at the end."""
    roles = [("edge", EDGE_HOST), *((name, FIRST_NODE_HOST + index) for index, name in enumerate(node_names))]
    with contextlib.ExitStack() as cleanup:
        for name in node_names:  # the L1 arenas (files of l1_host_gb each, left by a SIGKILLed kvstore); logs stay
            cleanup.callback(shutil.rmtree, directory / name / "l1", True)
        cleanup.callback(reap_spawned)
        net = cleanup.enter_context(network(roles))
        keys_file, secret, secret_file = make_api_key(directory)
        nodes = [Node(name, net[name], directory / name) for name in node_names]
        for node in nodes:
            node.start(keys_file)
        client = NamespaceClient(net["edge"], directory / "client.log")
        the_fleet = Fleet(net, directory, nodes, client, secret, secret_file)
        try:
            for mode in envoy_modes:
                the_fleet.start_envoy(mode)
            for node in nodes:
                node.wait_ready(client)
            the_fleet.wait_envoys_ready()
            yield the_fleet
        except BaseException:
            for node in nodes:
                print(f"--- {node.name}: {node.output}\n{tail(node.output)}")
            raise
        finally:
            client.close()

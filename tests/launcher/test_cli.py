"""`kvserve up --ranks 2` as a real process: redis, kvstore, router, two rank workers and the gateway start and
are wired together, a request goes through the gateway, a killed service is restarted, Ctrl-C leaves no
process behind; `kvserve complete` against a rank; `up`'s clear failures (a service that cannot start,
no redis-server, a port in use); `kvserve keys create --metrics`."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from service_processes import ANY_PORTS, free_port, running_process, service_env
from tokenizers import Tokenizer

from contracts import internal_auth
from gateway.http.auth import KeyStore
from gateway.prompt.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from launcher.claude_code_env import claude_code_environment
from launcher.complete import CompletionArgs, complete, prompt_token_ids
from launcher.health_check import HealthCheck, probe
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc
from protos import router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["redis", "kvstore", "router", "rank-worker-0", "rank-worker-1", "gateway"]
REQUEST_TIMEOUT_SECS = 900  # the config file's: what the printed Claude Code timeouts must follow


def kvserve(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=ROOT,
        env=env or service_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_services(state_dir: Path) -> dict[str, dict[str, object]]:
    data = json.loads((state_dir / "services.json").read_text())
    return {entry["name"]: entry for entry in data["services"]}


def gone(pid: int) -> bool:
    """Neither the process nor anything left in its process group (each service leads its own)."""
    for check in (lambda: os.kill(pid, 0), lambda: os.killpg(pid, 0)):
        try:
            check()
            return False
        except ProcessLookupError:
            pass
    return True


@dataclass
class Stack:
    process: subprocess.Popen[bytes]
    output: Path
    state_dir: Path

    def services(self) -> dict[str, dict[str, object]]:
        return read_services(self.state_dir)

    def address(self, name: str) -> str:
        return str(self.services()[name]["address"])

    @property
    def gateway_url(self) -> str:
        return f"http://{self.address('gateway')}"

    @property
    def rank_target(self) -> str:
        return self.address("rank-worker-0")

    @property
    def secret(self) -> internal_auth.InternalSecret:
        """The internal secret `up` made in its state dir (not the test process's own)."""
        return internal_auth.read_secret_file(self.state_dir / "internal-secret")

    def text(self) -> str:
        return self.output.read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("kvserve-up")
    output, state_dir = tmp / "up.log", tmp / "state"
    config_file = tmp / "config.yaml"  # model settings through the file: proves each service reads it
    config_file.write_text(
        f"num_kv_blocks: 128\nmax_model_len: 1024\nl1_host_gb: 0.25\nl1_arena_dir: {tmp}\nmax_num_batched_tokens: 512\n"
        f"request_timeout_secs: {REQUEST_TIMEOUT_SECS}\n"
    )
    env = service_env(**ANY_PORTS)

    def ready(process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 240
        while "Ctrl-C" not in output.read_text(errors="replace"):  # printed once the gateway is ready
            assert time.monotonic() < deadline and process.poll() is None, output.read_text(errors="replace")
            time.sleep(0.2)

    # Started with SIGINT ignored, as a background job of a script is: `up` must still stop on SIGINT.
    command = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable, "-m", "launcher.cli", "up"]
    command += ["--ranks", "2", "--config", str(config_file)]
    command += ["--state-dir", str(state_dir)]
    with running_process(command, env, output, ready, stop_signal=signal.SIGINT, stop_timeout_s=60) as process:
        yield Stack(process, output, state_dir)
    print(output.read_text(errors="replace")[-3000:])


@pytest.fixture(scope="module")
def model_info(stack: Stack) -> pb.ModelInfoResponse:
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with internal_auth.channel(stack.rank_target, options=options, secret=stack.secret) as channel:
        return pb_grpc.RankWorkerStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)


@pytest.fixture(scope="module")
def tokenizer(model_info: pb.ModelInfoResponse) -> Tokenizer:
    return Tokenizer.from_str(model_info.tokenizer_json)


def test_up_prints_the_endpoint_and_an_example(stack: Stack) -> None:
    text = stack.text()
    for name in SERVICES[:-1]:
        assert f"  {name}: {stack.address(name)} (" in text
    assert "kvserve complete" in text and f"--target {stack.rank_target}" in text
    assert f"export ANTHROPIC_BASE_URL={stack.gateway_url}\n" in text
    for variable in ("ANTHROPIC_API_KEY", "ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL"):
        assert f"export {variable}=" in text
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=921\n" in text  # 90% of the config file's max_model_len 1024
    assert httpx.get(f"{stack.gateway_url}/ready", timeout=5).json()["status"] == "ready"


def printed_exports(text: str) -> dict[str, str]:
    lines = (line.strip().removeprefix("export ") for line in text.splitlines() if line.strip().startswith("export "))
    return dict(line.split("=", 1) for line in lines)


def test_printed_claude_code_exports_follow_the_config(stack: Stack) -> None:
    """Claude Code waits as long as the gateway lets a request run (no longer than a minute more, or it
    promises what the gateway's deadline breaks), and its output is capped within the context."""
    exports = printed_exports(stack.text())
    assert exports == claude_code_environment(
        stack.gateway_url, exports["ANTHROPIC_MODEL"], 1024, REQUEST_TIMEOUT_SECS, on_cpu=True
    )  # what the Claude Code end-to-end test runs the CLI with
    for variable in ("API_TIMEOUT_MS", "CLAUDE_STREAM_IDLE_TIMEOUT_MS"):
        assert REQUEST_TIMEOUT_SECS <= int(exports[variable]) / 1000 <= REQUEST_TIMEOUT_SECS + 60, variable
    assert 0 < int(exports["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) <= 1024 // 8


def test_up_starts_every_service_and_wires_them(stack: Stack) -> None:
    services = stack.services()
    assert list(services) == SERVICES
    assert all(not gone(int(entry["pid"])) for entry in services.values())  # type: ignore[call-overload]
    assert probe(HealthCheck("redis", stack.address("redis"), str(stack.state_dir / "redis-password"))) is None
    for name in ("kvstore", "router", "rank-worker-0", "rank-worker-1"):
        assert probe(HealthCheck("grpc", stack.address(name))) is None, name
    # Both ranks registered with the router under their ids and advertised addresses; Redis reached.
    deadline = time.monotonic() + 30
    with internal_auth.channel(stack.address("router"), secret=stack.secret) as channel:
        while True:
            listing = router_pb2_grpc.RouterStub(channel).ListRanks(router_pb2.ListRanksRequest(), timeout=10)
            ranks = {rank.rank_id: rank for rank in listing.ranks}
            if (len(ranks) == 2 and all(rank.healthy for rank in ranks.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert {rank_id: rank.address for rank_id, rank in ranks.items()} == {
        "rank-0": stack.address("rank-worker-0"),
        "rank-1": stack.address("rank-worker-1"),
    }
    assert all(rank.healthy for rank in ranks.values())
    assert listing.redis_connected
    logs = {name: Path(str(entry["log"])) for name, entry in services.items()}
    assert all(path.is_file() and path.parent == stack.state_dir / "logs" for path in logs.values())


def test_a_request_through_the_gateway(stack: Stack) -> None:
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}
    response = httpx.post(f"{stack.gateway_url}/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["type"] == "message" and message["content"][0]["text"]
    assert 0 < message["usage"]["output_tokens"] <= 4


def test_prompt_goes_through_the_chat_template(model_info: pb.ModelInfoResponse, tokenizer: Tokenizer) -> None:
    ids = prompt_token_ids(model_info, tokenizer, CompletionArgs("Hi there", system="Be brief."))
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    im_start = tokenizer.token_to_id("<|im_start|>")
    assert ids.count(im_start) == 3  # specials are single tokens, not spelled out


def test_raw_prompt_skips_the_template(model_info: pb.ModelInfoResponse, tokenizer: Tokenizer) -> None:
    ids = prompt_token_ids(model_info, tokenizer, CompletionArgs("Once upon a time", raw=True))
    assert tokenizer.decode(ids) == "Once upon a time"


def test_real_tokenizer_streams_multibyte_text_cleanly(tokenizer: Tokenizer) -> None:
    text = "Pizza 🍕, café, naïve, 東京, and ∑ signs."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push([token]) for token in ids]
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.finish() == text


def test_complete_streams_text_and_stats(stack: Stack) -> None:
    out, err = io.StringIO(), io.StringIO()
    args = CompletionArgs("What is the capital of France?", max_tokens=12)
    code = complete(stack.rank_target, args, out, err, secret=stack.secret)
    assert code == 0
    assert out.getvalue().strip()
    stats = err.getvalue()
    assert "[prompt " in stats and "cached" in stats and "tok/s" in stats and "prefill" in stats


def test_kvserve_complete_command(stack: Stack) -> None:
    secret_flag = ("--secret-file", str((stack.state_dir / "internal-secret").resolve()))
    assert " ".join(secret_flag) in stack.text()  # the printed example names the state dir's secret
    result = kvserve("complete", "Say hello.", "--max-tokens", "6", "--target", stack.rank_target, *secret_flag)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "[prompt " in result.stderr


def test_kvserve_complete_reports_bad_input(stack: Stack) -> None:
    secret_flag = ("--secret-file", str(stack.state_dir / "internal-secret"))
    result = kvserve("complete", "Say hello.", "--max-tokens", "0", "--target", stack.rank_target, *secret_flag)
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "max_tokens" in result.stderr


def test_up_keeps_its_secrets_private_and_its_stack_closed(stack: Stack) -> None:
    """The internal secret and Redis's password are made 0600 in the state dir; the password reaches Redis
    through a 0600 config file, not its argv; a call without the secret, or with another one, is refused."""
    for name in ("internal-secret", "redis-password", "redis-auth.conf"):
        assert (stack.state_dir / name).stat().st_mode & 0o777 == 0o600, name
    password = (stack.state_dir / "redis-password").read_text().strip()
    redis_pid = int(stack.services()["redis"]["pid"])  # type: ignore[call-overload]
    argv = Path(f"/proc/{redis_pid}/cmdline").read_bytes().split(b"\0")
    assert b"redis-server" in argv[0] and not any(password.encode() in word for word in argv)
    assert probe(HealthCheck("redis", stack.address("redis"))).startswith("NOAUTH")  # type: ignore[union-attr]
    # the test process's own secret (service_processes) is not this stack's
    result = kvserve("complete", "Say hello.", "--max-tokens", "2", "--target", stack.rank_target)
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr


def test_kvserve_complete_unreachable_target() -> None:
    result = kvserve("complete", "x", "--target", f"127.0.0.1:{free_port()}", timeout=60)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def test_a_killed_service_is_restarted(stack: Stack) -> None:
    before = stack.services()["rank-worker-1"]
    os.kill(int(before["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    deadline = time.monotonic() + 180
    while "rank-worker-1: healthy again" not in stack.text():
        assert time.monotonic() < deadline and stack.process.poll() is None, stack.text()[-3000:]
        time.sleep(0.3)
    after = stack.services()["rank-worker-1"]
    assert after["pid"] != before["pid"] and after["address"] == before["address"]
    assert "rank-worker-1 exited with code -9; restarting it" in stack.text()
    assert probe(HealthCheck("grpc", str(after["address"]))) is None
    assert all(not gone(int(entry["pid"])) for entry in stack.services().values())  # type: ignore[call-overload]


def test_up_stops_everything_on_ctrl_c(stack: Stack) -> None:
    services = stack.services()
    stack.process.send_signal(signal.SIGINT)
    assert stack.process.wait(timeout=60) == 0
    text = stack.text()
    assert "stopping..." in text and text.rstrip().endswith("stopped")
    left = [name for name, entry in services.items() if not gone(int(entry["pid"]))]  # type: ignore[call-overload]
    assert left == []
    assert probe(HealthCheck("grpc", stack.rank_target), timeout_s=2) == "gRPC UNAVAILABLE"
    assert probe(HealthCheck("redis", stack.address("redis")), timeout_s=2) is not None


def test_up_leaves_its_state_dir_private(stack: Stack) -> None:
    """Logs and Redis's dump and append-only files hold session ids: the state dir is its user's alone."""
    assert stack.process.poll() is not None  # after the stop, when Redis has saved its dump
    readable = []
    for directory, _, files in os.walk(stack.state_dir):
        for path in [Path(directory)] + [Path(directory, name) for name in files]:
            expected = 0o700 if path.is_dir() else 0o600
            if path.stat().st_mode & 0o777 != expected:
                readable.append(f"{path.relative_to(stack.state_dir)} {oct(path.stat().st_mode & 0o777)}")
    assert (stack.state_dir / "redis" / "appendonlydir").is_dir()
    assert (stack.state_dir / "logs" / "gateway.log").exists()
    assert readable == []


def test_up_reports_a_service_that_fails_to_start(tmp_path: Path) -> None:
    env = service_env(**ANY_PORTS, KVSERVE_MODEL=str(tmp_path / "missing.gguf"), KVSERVE_L1_ARENA_DIR=str(tmp_path))
    result = kvserve("up", "--state-dir", str(tmp_path / "state"), env=env, timeout=180)
    assert result.returncode == 1
    assert "rank-worker-0 exited with code" in result.stdout
    assert "missing.gguf" in result.stdout  # the tail of the rank's own log says why
    services = read_services(tmp_path / "state")
    assert list(services) == SERVICES[:4]  # the gateway never started
    assert all(gone(int(entry["pid"])) for entry in services.values())  # type: ignore[call-overload]


def test_up_without_redis_server_says_how_to_install_it(tmp_path: Path) -> None:
    env = service_env(**ANY_PORTS, PATH=str(tmp_path))  # nothing on PATH; python is sys.executable
    result = kvserve("up", "--state-dir", str(tmp_path / "state"), env=env)
    assert result.returncode == 1
    assert "redis-server not found" in result.stdout and "apt-get install redis-server" in result.stdout
    assert not (tmp_path / "state").exists()  # nothing was started


def test_up_reports_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = service_env(**{**ANY_PORTS, "KVSERVE_GATEWAY_PORT": str(port)})
        result = kvserve("up", "--state-dir", str(tmp_path / "state"), env=env)
    assert result.returncode == 1
    assert f"gateway cannot listen on 127.0.0.1:{port}" in result.stdout and "gateway_port" in result.stdout


def test_up_refuses_zero_ranks() -> None:
    result = kvserve("up", "--ranks", "0")
    assert result.returncode == 2 and "--ranks must be at least 1" in result.stderr


def test_kvserve_secret_create_makes_a_private_file_once(tmp_path: Path) -> None:
    path = tmp_path / "kvserve-internal-secret"
    result = kvserve("secret", "create", "--file", str(path))
    assert result.returncode == 0 and "mode 0600" in result.stderr
    assert path.stat().st_mode & 0o777 == 0o600
    secret = internal_auth.read_secret_file(path)  # long and plain enough for every service to take it
    again = kvserve("secret", "create", "--file", str(path))
    assert again.returncode == 0 and "kept it" in again.stderr
    assert internal_auth.read_secret_file(path) == secret  # running services keep working


def test_kvserve_keys_create_writes_the_metrics_scope(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    created = {
        name: kvserve("keys", "create", "--name", name, *flags, "--file", str(path))
        for name, flags in (
            ("scraper", ["--metrics"]),  # alone: /metrics and no model
            ("ops", ["--models", "*", "--metrics"]),
            ("app", []),  # every model, not /metrics
        )
    }
    assert all(result.returncode == 0 for result in created.values()), [r.stderr for r in created.values()]
    assert "for GET /metrics in" in created["scraper"].stderr
    assert "for models * and GET /metrics in" in created["ops"].stderr
    store = KeyStore.load(path)
    scopes = {name: store.authenticate(result.stdout.strip(), None) for name, result in created.items()}
    assert (scopes["scraper"].models, scopes["scraper"].scopes) == ((), ("metrics",))
    assert (scopes["ops"].models, scopes["ops"].scopes) == (("*",), ("metrics",))
    assert (scopes["app"].models, scopes["app"].scopes) == (("*",), ())

    listed = kvserve("keys", "list", "--file", str(path))
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0] == ["ID", "NAME", "MODELS", "SCOPES", "CREATED"]
    assert [row[1:4] for row in rows[1:]] == [["scraper", "-", "metrics"], ["ops", "*", "metrics"], ["app", "*", "-"]]

    nothing = kvserve("keys", "create", "--name", "nothing", "--models", "", "--file", str(path))
    assert nothing.returncode == 1 and "--models" in nothing.stderr and not nothing.stdout
    usage = " ".join(kvserve("keys", "create", "--help").stdout.split())  # as argparse wraps it at any width
    assert "--metrics" in usage and "GET /metrics" in usage and "'*' included" in usage

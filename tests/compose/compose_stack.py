"""The CPU node's compose stack as `make test-compose` runs it: a project folder holding the config, the compose
file `kvserve compose --cpu` renders from it and the three secret files, driven through the docker CLI (the
daemon DOCKER_HOST names, the Compose plugin DOCKER_CONFIG holds; tests/compose/run sets both)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import yaml

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = ROOT / "config" / "compose-cpu.yaml"
CONTAINER_UID = "1000"  # the Dockerfile's kvserve user: the secret files must be its own
SECRET_FILES = ("kvserve-keys.json", "kvserve-internal-secret", "kvserve-redis-password")


def run(command: list[str], timeout_s: float = 120, check: bool = True, cwd: Path | None = None) -> str:
    """A command's stdout; on failure (check) an AssertionError with its output."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def kvserve(*args: str) -> str:
    return run([sys.executable, "-m", "launcher.cli", *args], cwd=ROOT)


@dataclass
class ComposeStack:
    directory: Path
    port: int = 0
    api_key: str = ""
    ranks: int = 0

    @property
    def compose_file(self) -> Path:
        return self.directory / "docker-compose.yml"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prepare(self, port: int) -> None:
        """A fresh project: the CPU config with the gateway on `port` (the one published), an API key, the internal
        secret and Redis's password, as docs/compose.md says (0600), owned by the containers' user."""
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(parents=True)
        (self.directory / "models").mkdir()
        config = yaml.safe_load(CPU_CONFIG.read_text())
        config["gateway_port"] = port
        (self.directory / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = port
        keys = self.directory / "kvserve-keys.json"
        self.api_key = kvserve("keys", "create", "--name", "compose-test", "--file", str(keys)).strip()
        for name in SECRET_FILES[1:]:
            kvserve("secret", "create", "--file", str(self.directory / name))
        for name in SECRET_FILES:
            os.chown(self.directory / name, int(CONTAINER_UID), -1)

    def render(self, ranks: int) -> dict[str, Any]:
        """`kvserve compose --cpu --ranks N` into the project; returns the document."""
        kvserve("compose", "--cpu", "--ranks", str(ranks), "--config", str(self.directory / "config.yaml"),
                "--output", str(self.compose_file))  # fmt: skip
        self.ranks = ranks
        return yaml.safe_load(self.compose_file.read_text())

    def compose(self, *args: str, timeout_s: float = 120, check: bool = True) -> str:
        return run(["docker", "compose", "-f", str(self.compose_file), *args], timeout_s, check, self.directory)

    def up(self, timeout_s: float = 600, preflight: bool = False) -> float:
        """docker compose up -d, waiting until every service is healthy; returns the seconds it took. preflight:
        `kvserve preflight` first (nothing in the way: GPUs, secrets, the port), as before a first start (not
        while the stack runs: its own gateway holds the port)."""
        if preflight:
            kvserve("preflight", "--file", str(self.compose_file))
        started = time.monotonic()
        self.compose("up", "-d", "--wait", "--wait-timeout", str(int(timeout_s)), timeout_s=timeout_s + 60)
        return time.monotonic() - started

    def container(self, service: str) -> str:
        container_id = self.compose("ps", "-a", "-q", service).strip()
        assert container_id, f"no container for {service}"
        return container_id

    def inspect(self, service: str) -> dict[str, Any]:
        return json.loads(run(["docker", "inspect", self.container(service)]))[0]

    def exec(self, service: str, *command: str) -> str:
        return self.compose("exec", "-T", service, *command)

    def crash(self, service: str) -> None:
        """SIGKILL to the container's main process from the host: what a crash or the OOM killer does. (`docker
        kill` is a manual stop to Docker: no restart policy restarts a container it killed.)"""
        os.kill(self.inspect(service)["State"]["Pid"], signal.SIGKILL)

    def wait_until(self, what: str, condition: Callable[[], bool], timeout_s: float = 120) -> float:
        started = time.monotonic()
        while not condition():
            assert time.monotonic() - started < timeout_s, f"timed out after {timeout_s:.0f} s waiting for {what}"
            time.sleep(0.5)
        return time.monotonic() - started

    def healthy(self, service: str) -> bool:
        state = self.inspect(service)["State"]
        return state["Running"] and state.get("Health", {}).get("Status") == "healthy"

    def peak_memory_mib(self, service: str) -> float | None:
        """The most memory the service's container has used (its cgroup's peak), where the host shows it."""
        container_id = self.container(service)
        for path in (
            Path("/sys/fs/cgroup/memory/docker", container_id, "memory.max_usage_in_bytes"),  # cgroup v1
            Path("/sys/fs/cgroup/docker", container_id, "memory.peak"),  # v2
        ):
            if path.is_file():
                return int(path.read_text()) / 2**20
        return None

    def memory_report(self) -> str:
        services = yaml.safe_load(self.compose_file.read_text())["services"]
        lines = []
        for name, service in services.items():
            limit = service.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory", "-")
            peak = self.peak_memory_mib(name)
            lines.append(f"  {name:<16} limit {limit:>6}  peak {'?' if peak is None else f'{peak:.0f}m':>6}")
        return "\n".join(lines)

    def down(self) -> None:
        """docker compose down -v, its services' logs kept first (in logs/compose.log beside the project)."""
        if self.compose("ps", "-a", "-q", check=False).strip():
            log = self.directory.parent / "logs" / "compose.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(self.compose("logs", "--no-color", "--timestamps", check=False, timeout_s=60))
        self.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout_s=180)

    def client(self, api_key: str | None = None) -> anthropic.Anthropic:
        key = self.api_key if api_key is None else api_key
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=600)


@dataclass
class StreamResult:
    message_id: str
    event_types: list[str]
    text: str
    output_tokens: int


def stream_story(
    client: anthropic.Anthropic, max_tokens: int, on_delta: Callable[[int, str], None] | None = None
) -> StreamResult:
    """A greedy streamed reply of exactly max_tokens tokens (ignore_eos), through the Anthropic SDK, which raises
    on an error event or a cut connection; on_delta(count, message_id) after each text delta."""
    event_types: list[str] = []
    text: list[str] = []
    message_id = ""
    output_tokens = 0
    stream = client.messages.create(
        model="default",
        max_tokens=max_tokens,
        stream=True,
        messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper and a cache."}],
        extra_body={"temperature": 0, "ignore_eos": True},  # the SDK no longer takes temperature
    )
    for event in stream:
        event_types.append(event.type)
        if event.type == "message_start":
            message_id = event.message.id
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            text.append(event.delta.text)
            if on_delta is not None:
                on_delta(len(text), message_id)
        elif event.type == "message_delta":
            output_tokens = event.usage.output_tokens
    return StreamResult(message_id, event_types, "".join(text), output_tokens)

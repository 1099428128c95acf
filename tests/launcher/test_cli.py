"""`kvserve up` starting a real rank worker, `kvserve complete` against it, and a clean Ctrl-C stop."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from service_processes import free_port, running_process, service_env
from tokenizers import Tokenizer

from gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from launcher.complete import CompletionArgs, complete, prompt_token_ids
from launcher.health import wait_for_serving
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


def kvserve(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=ROOT,
        env=env or service_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class Stack:
    target: str
    process: subprocess.Popen[bytes]
    output: Path
    gateway_url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    port, gateway_port = free_port(), free_port()
    output = tmp_path_factory.mktemp("kvserve-up") / "up.log"
    env = service_env(
        KVSERVE_RANK_WORKER_PORT=str(port),
        KVSERVE_GATEWAY_PORT=str(gateway_port),
        KVSERVE_NUM_KV_BLOCKS="128",
        KVSERVE_MAX_MODEL_LEN="1024",
    )

    def ready(process: subprocess.Popen[bytes]) -> None:
        wait_for_serving(f"127.0.0.1:{port}", timeout_s=180, process=process)
        deadline = time.monotonic() + 30
        while "Ctrl-C" not in output.read_text(errors="replace"):  # `up` prints once it saw SERVING itself
            assert time.monotonic() < deadline and process.poll() is None, output.read_text(errors="replace")
            time.sleep(0.1)

    command = [sys.executable, "-m", "launcher.cli", "up"]
    with running_process(command, env, output, ready, stop_signal=signal.SIGINT, stop_timeout_s=40) as process:
        yield Stack(f"127.0.0.1:{port}", process, output, f"http://127.0.0.1:{gateway_port}")
    print(output.read_text(errors="replace")[-3000:])


@pytest.fixture(scope="module")
def model_info(stack: Stack) -> pb.ModelInfoResponse:
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(stack.target, options=options) as channel:
        return pb_grpc.RankWorkerStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30)


@pytest.fixture(scope="module")
def tokenizer(model_info: pb.ModelInfoResponse) -> Tokenizer:
    return Tokenizer.from_str(model_info.tokenizer_json)


def test_up_prints_the_endpoint_and_an_example(stack: Stack) -> None:
    text = stack.output.read_text(errors="replace")
    assert stack.target in text
    assert "kvserve complete" in text and f"--target {stack.target}" in text
    assert f"export ANTHROPIC_BASE_URL={stack.gateway_url}" in text
    for variable in ("ANTHROPIC_API_KEY", "ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL"):
        assert f"export {variable}=" in text
    assert "export CLAUDE_CODE_MAX_CONTEXT_TOKENS=921\n" in text  # 90% of max_model_len 1024
    assert httpx.get(f"{stack.gateway_url}/ready", timeout=5).json()["status"] == "ready"


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
    code = complete(stack.target, CompletionArgs("What is the capital of France?", max_tokens=12), out, err)
    assert code == 0
    assert out.getvalue().strip()
    stats = err.getvalue()
    assert "[prompt " in stats and "cached" in stats and "tok/s" in stats and "prefill" in stats


def test_kvserve_complete_command(stack: Stack) -> None:
    result = kvserve("complete", "Say hello.", "--max-tokens", "6", "--target", stack.target)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "[prompt " in result.stderr


def test_kvserve_complete_reports_bad_input(stack: Stack) -> None:
    result = kvserve("complete", "Say hello.", "--max-tokens", "0", "--target", stack.target)
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "max_tokens" in result.stderr


def test_kvserve_complete_unreachable_target() -> None:
    result = kvserve("complete", "x", "--target", f"127.0.0.1:{free_port()}", timeout=60)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def test_up_reports_a_worker_that_fails_to_start(tmp_path: Path) -> None:
    env = service_env(KVSERVE_RANK_WORKER_PORT=str(free_port()), KVSERVE_MODEL=str(tmp_path / "missing.gguf"))
    result = kvserve("up", "--ready-timeout", "120", env=env, timeout=150)
    assert result.returncode == 1
    assert "exited with code" in result.stdout


def test_up_stops_cleanly_on_ctrl_c(stack: Stack) -> None:
    stack.process.send_signal(signal.SIGINT)
    assert stack.process.wait(timeout=40) == 0
    assert "stopping" in stack.output.read_text(errors="replace")
    with grpc.insecure_channel(stack.target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.RankWorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the worker is gone too

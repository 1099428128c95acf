"""The internal plane refuses callers without its secret (real processes): every RPC of the router, the
kvstore and a rank worker, called with no secret or a wrong one, is UNAUTHENTICATED, so no local process can
register a fake rank, report a healthy one failed, call Generate past the gateway's keys, or read the L1
index. Health checks stay open (compose and `kvserve up` probe them). Redis refuses a client without its
password while the router, given the password file, uses it. A service with no secret refuses to start.
With the secret everything serves: the rest of the suite runs that way."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_processes import ROOT, free_port, redis_client, service_env
from whole_stack import Stack, whole_stack

from contracts.internal_auth import METADATA_KEY, SCHEME, process_secret
from protos import kvstore_pb2, rank_worker_pb2, router_pb2

SERVICES = {
    "router": router_pb2.DESCRIPTOR.services_by_name["Router"],
    "kvstore": kvstore_pb2.DESCRIPTOR.services_by_name["KvStore"],
    "rank-0": rank_worker_pb2.DESCRIPTOR.services_by_name["RankWorker"],
}
EVERY_RPC = [(name, method) for name, service in SERVICES.items() for method in service.methods]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    rank_settings = {"KVSERVE_NUM_KV_BLOCKS": "64", "KVSERVE_MAX_MODEL_LEN": "512"}
    with whole_stack(tmp_path_factory.mktemp("auth"), ranks=1, rank_settings=rank_settings, gateway=False) as s:
        yield s


def wrong_secret() -> str:
    secret = process_secret()
    assert secret is not None, "the test process has the suite's secret"
    return SCHEME + "x" * len(secret.token)  # as long as the real one: only its content differs


def call_raw(address: str, method: object, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    """One call of `method` with an empty request over a plain channel (no secret added); its status."""
    path = f"/{method.containing_service.full_name}/{method.name}"  # type: ignore[attr-defined]
    with grpc.insecure_channel(address) as channel:
        try:
            if method.server_streaming:  # type: ignore[attr-defined]
                for _ in channel.unary_stream(path)(b"", metadata=metadata, timeout=10):
                    pass
            else:
                channel.unary_unary(path)(b"", metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.parametrize(("service", "method"), EVERY_RPC, ids=[f"{s}.{m.name}" for s, m in EVERY_RPC])
def test_every_internal_rpc_refuses_a_call_without_the_secret(stack: Stack, service: str, method: object) -> None:
    address = stack[service].address
    assert call_raw(address, method, []) == grpc.StatusCode.UNAUTHENTICATED
    assert call_raw(address, method, [(METADATA_KEY, wrong_secret())]) == grpc.StatusCode.UNAUTHENTICATED
    assert call_raw(address, method, [("kvserve-internal-secret", "anything")]) == grpc.StatusCode.UNAUTHENTICATED


def test_a_fake_rank_never_reaches_the_routing_table(stack: Stack) -> None:
    register = router_pb2.RegisterRankRequest(rank_id="intruder", address="127.0.0.1:1", incarnation="x")
    with grpc.insecure_channel(stack["router"].address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(
                "/kvserve.router.v1.Router/RegisterRank", request_serializer=lambda m: m.SerializeToString()
            )(register, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    ranks = stack.router_ranks().ranks  # with the secret: the router serves
    assert [rank.rank_id for rank in ranks] == ["rank-0"] and ranks[0].healthy


def test_with_the_secret_every_service_answers(stack: Stack) -> None:
    assert stack.rank_stats("rank-0").total_blocks == 64
    assert stack.kvstore_stats().arena_bytes > 0
    assert stack.router_ranks().redis_connected  # the router authenticated to Redis with its password file


def test_health_checks_stay_open(stack: Stack) -> None:
    for name in SERVICES:
        with grpc.insecure_channel(stack[name].address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


def test_redis_refuses_a_client_without_its_password(stack: Stack) -> None:
    port = stack["redis"].port
    for password in (None, "wrong"):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5).keys("kvserve:*")
    records = redis_client(port, socket_timeout=5).keys("kvserve:rank:*")
    assert records == [b"kvserve:rank:rank-0"]  # the router wrote the rank through its authenticated client


@pytest.mark.parametrize("module", ["kvstore", "router", "rank_worker"])
def test_a_service_without_a_secret_refuses_to_start(module: str, tmp_path: Path) -> None:
    env = service_env(KVSERVE_INTERNAL_SECRET_FILE="", KVSERVE_L1_ARENA_DIR=str(tmp_path))
    command = [sys.executable, "-m", module, "--port", str(free_port())]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "needs a shared secret" in result.stderr and "kvserve secret create" in result.stderr


def test_auth_off_is_refused_beyond_loopback(tmp_path: Path) -> None:
    env = service_env(
        KVSERVE_INTERNAL_SECRET_FILE="", KVSERVE_INTERNAL_AUTH="false", KVSERVE_L1_ARENA_DIR=str(tmp_path)
    )
    command = [sys.executable, "-m", "kvstore", "--host", "0.0.0.0", "--port", str(free_port())]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "internal_auth is off, but this service binds 0.0.0.0" in result.stderr

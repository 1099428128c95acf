"""contracts.internal_auth directly: secret files (mode 0600, kept once made, refused when too weak), what a
process may run with (a secret, or auth off on loopback only), the constant-time check of the metadata, and
channels that carry the secret to a real grpc.aio server with the check (the services' e2e test covers every
RPC of every service)."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts import internal_auth
from contracts.config import KvServeConfig
from contracts.internal_auth import InternalAuthError, InternalSecret, SecretCheck


def config(**values: object) -> KvServeConfig:
    return KvServeConfig(**values)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def keep_process_secret() -> object:
    saved = internal_auth._process_secret
    yield
    internal_auth._process_secret = saved


def test_a_new_secret_file_is_private_random_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "run" / "internal-secret"
    assert internal_auth.create_secret_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = internal_auth.read_secret_file(path)
    assert len(first.token) >= internal_auth.MIN_SECRET_CHARS
    path.chmod(0o644)
    assert not internal_auth.create_secret_file(path)  # an existing secret is kept (services hold it)...
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # ...and made private again
    assert internal_auth.read_secret_file(path) == first
    other = tmp_path / "other"
    internal_auth.create_secret_file(other)
    assert internal_auth.read_secret_file(other) != first


@pytest.mark.parametrize(
    ("content", "reason"),
    [("short", "fewer than 32"), ("a" * 20 + " " + "b" * 20, "spaces"), ("é" * 40, "not ASCII")],
)
def test_weak_or_unusable_secrets_are_refused(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / "secret"
    path.write_text(content)
    with pytest.raises(InternalAuthError, match=reason):
        internal_auth.read_secret_file(path)
    with pytest.raises(InternalAuthError, match="cannot read"):
        internal_auth.read_secret_file(tmp_path / "missing")


def test_the_secret_never_shows_in_a_repr(tmp_path: Path) -> None:
    secret = InternalSecret("t" * 40, "/some/file")
    assert "t" * 40 not in repr(secret) and "/some/file" in repr(secret)


def test_a_process_needs_a_secret_unless_auth_is_off_on_loopback(tmp_path: Path) -> None:
    with pytest.raises(InternalAuthError, match="kvserve secret create"):
        internal_auth.configure(config(internal_secret_file=""), "127.0.0.1")
    with pytest.raises(InternalAuthError, match=r"binds 0\.0\.0\.0"):
        internal_auth.configure(config(internal_auth=False), "0.0.0.0")
    assert internal_auth.configure(config(internal_auth=False), "127.0.0.1") is None
    assert internal_auth.process_secret() is None  # off: its channels send nothing
    assert internal_auth.configure(config(internal_auth=False), None) is None  # a client only (the gateway)
    path = tmp_path / "secret"
    internal_auth.create_secret_file(path)
    secret = internal_auth.configure(config(internal_secret_file=str(path)), "0.0.0.0")
    assert secret == internal_auth.read_secret_file(path) == internal_auth.process_secret()


def test_the_check_wants_exactly_our_secret_once() -> None:
    secret = InternalSecret("s" * 40)
    check = SecretCheck(secret, "test")
    good = (internal_auth.METADATA_KEY, secret.header_value)
    assert check.authorized([good])
    assert check.authorized([("other", "x"), good])
    assert not check.authorized(None)
    assert not check.authorized([(internal_auth.METADATA_KEY, "Bearer " + "s" * 39 + "t")])
    assert not check.authorized([(internal_auth.METADATA_KEY, "s" * 40)])  # without the scheme
    assert not check.authorized([good, (internal_auth.METADATA_KEY, "Bearer x")])  # two answers: ambiguous
    assert not check.authorized([("kvserve-internal-secret", secret.header_value)])


async def _serve_health(secret: InternalSecret) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=internal_auth.server_interceptors(secret, "test"))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_channels_carry_the_secret_and_health_stays_open() -> None:
    """Health is the one open method: a real aio server with the check answers it for anyone, and the
    methods behind the check (here: the same handler under an unknown path) only for our channels."""
    secret, stranger = InternalSecret("k" * 40), InternalSecret("z" * 40)

    async def scenario() -> None:
        server, target = await _serve_health(secret)
        try:
            async with grpc.aio.insecure_channel(target) as plain:
                reply = await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await plain.unary_unary("/kvserve.test.v1.Hidden/Call")(b"", timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for channel_secret, expected in ((secret, grpc.StatusCode.UNIMPLEMENTED), (stranger, None)):
                async with internal_auth.aio_channel(target, secret=channel_secret) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as answered:
                        await channel.unary_unary("/kvserve.test.v1.Hidden/Call")(b"", timeout=5)
                    # with our secret the call gets past the check (and finds no such method)
                    assert answered.value.code() == (expected or grpc.StatusCode.UNAUTHENTICATED)
            with internal_auth.channel(target, secret=secret) as blocking:
                with pytest.raises(grpc.RpcError) as answered_sync:
                    await asyncio.to_thread(blocking.unary_unary("/kvserve.test.v1.Hidden/Call"), b"", timeout=5)
                assert answered_sync.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
        finally:
            await server.stop(0)

    asyncio.run(scenario())

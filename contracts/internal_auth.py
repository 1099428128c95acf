"""The internal plane's shared secret: every internal gRPC call (to the router, the kvstore, a rank worker)
carries it, and every internal server refuses a call without it (UNAUTHENTICATED, compared in constant time).

One secret per deployment, in a file (`internal_secret_file`): `kvserve up` generates one into its state dir
(mode 0600), compose mounts one as a secret (`kvserve secret create --file kvserve-internal-secret`). Each
process reads it once at start (configure()); the channel factories here add it to every call they carry,
so clients open internal channels with channel() / aio_channel() and nothing else.

Health checks (grpc.health.v1) stay open: they say SERVING or not and nothing more, and compose's
healthchecks and `kvserve up`'s probes need no secret. Without a secret a service refuses to start unless
`internal_auth: false`, which only a loopback bind may use.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from contracts.address import is_loopback

if TYPE_CHECKING:
    from contracts.config import KvServeConfig

log = logging.getLogger("internal_auth")

METADATA_KEY = "authorization"
SCHEME = "Bearer "
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"
MIN_SECRET_CHARS = 32
REFUSAL_DETAILS = "this internal service requires the kvserve internal secret (internal_secret_file)"
REFUSAL_LOG_INTERVAL_S = 10.0  # a local process hammering a port must not flood the log

ChannelOptions = Sequence[tuple[str, Any]] | None


class InternalAuthError(ValueError):
    """The internal secret cannot be used as configured (missing, unreadable, too short, or auth off on a
    non-loopback bind); the message says what to do. A ValueError, so service mains report a bad config."""


@dataclass(frozen=True)
class InternalSecret:
    """The shared secret, as sent in `authorization: Bearer <token>` metadata."""

    token: str = field(repr=False)
    source: str = ""  # the file it came from, for messages

    @property
    def header_value(self) -> str:
        return SCHEME + self.token

    def matches(self, value: str | bytes) -> bool:
        """Constant-time comparison of a received metadata value with ours."""
        received = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
        return hmac.compare_digest(received, self.header_value.encode())


def read_secret_file(path: str | Path) -> InternalSecret:
    """The secret in `path` (surrounding whitespace ignored); InternalAuthError if it cannot serve as one."""
    path = Path(path)
    try:
        token = path.read_text(encoding="ascii").strip()
    except OSError as exc:
        raise InternalAuthError(f"cannot read the internal secret file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InternalAuthError(f"the internal secret file {path} is not ASCII text") from exc
    if len(token) < MIN_SECRET_CHARS:
        raise InternalAuthError(
            f"the internal secret in {path} has {len(token)} characters, fewer than {MIN_SECRET_CHARS}: "
            f"make a new one with `kvserve secret create --file {path}`"
        )
    if not all(33 <= ord(char) < 127 for char in token):  # what a gRPC metadata value can carry as is
        raise InternalAuthError(f"the internal secret in {path} has spaces or unprintable characters")
    with_others = path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    if with_others:
        log.warning("the internal secret file %s is readable by other users (mode %o): chmod 600 it", path, with_others)
    return InternalSecret(token, str(path))


def create_secret_file(path: str | Path) -> bool:
    """Write a new random secret to `path` with mode 0600 unless the file exists (then only its mode is
    tightened to 0600). True when a new secret was written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        return False
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_urlsafe(32) + "\n")  # 256 bits, URL-safe: fits metadata, Redis, URLs
    return True


# --- the process's secret: set once at start, used by every internal channel it opens ---

_UNSET = object()
_process_secret: Any = _UNSET


def configure(config: KvServeConfig, bind_host: str | None = None) -> InternalSecret | None:
    """Read the config's secret and make it this process's (what channel() and aio_channel() send).

    bind_host: where this process's internal server listens, if it has one. With internal_auth on, a
    secret file is required; with it off, only a loopback bind may serve (any local process can then call
    it, as without auth) and nothing is sent. Raises InternalAuthError with what to do."""
    if not config.internal_auth:
        if bind_host is not None and not is_loopback(bind_host):
            raise InternalAuthError(
                f"internal_auth is off, but this service binds {bind_host}: beyond loopback the internal plane "
                "needs its secret. Set internal_secret_file (`kvserve secret create --file PATH`), or bind 127.0.0.1"
            )
        if bind_host is not None:
            log.warning(
                "internal auth is OFF (internal_auth: false): any local process can call this service; "
                "allowed because it listens on loopback only"
            )
        use_secret(None)
        return None
    if not config.internal_secret_file:
        raise InternalAuthError(
            "the internal plane needs a shared secret: create one with `kvserve secret create --file PATH` and set "
            "internal_secret_file (KVSERVE_INTERNAL_SECRET_FILE=PATH); `kvserve up` and compose do this. For a "
            "service on loopback only, internal_auth: false runs without one"
        )
    secret = read_secret_file(config.internal_secret_file)
    use_secret(secret)
    return secret


def use_secret(secret: InternalSecret | None) -> None:
    """Make `secret` what this process's internal channels send (None: send nothing)."""
    global _process_secret
    _process_secret = secret


def process_secret() -> InternalSecret | None:
    """This process's secret; a process that never called configure() reads it from its environment
    (KVSERVE_INTERNAL_SECRET_FILE, or the config file KVSERVE_CONFIG names) on first use."""
    if _process_secret is _UNSET:
        from contracts.config import load_config

        try:
            config = load_config()
            use_secret(read_secret_file(config.internal_secret_file) if config.internal_secret_file else None)
        except (InternalAuthError, FileNotFoundError, ValueError) as exc:
            log.warning("no internal secret for this process's internal calls: %s", exc)
            use_secret(None)
    return _process_secret  # type: ignore[no-any-return]


# --- clients: channels that carry the secret ---


class _SyncCallDetails(
    collections.namedtuple(
        "_SyncCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncSecretMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, secret: InternalSecret) -> None:
        self._pair = (METADATA_KEY, secret.header_value)

    def _details(self, details: grpc.ClientCallDetails) -> _SyncCallDetails:
        metadata = [*(details.metadata or ()), self._pair]
        return _SyncCallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def channel(target: str, options: ChannelOptions = None, secret: InternalSecret | None = None) -> grpc.Channel:
    """A blocking channel to an internal service whose every call carries the secret (this process's
    unless given)."""
    secret = secret or process_secret()
    plain = grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(plain, _SyncSecretMetadata(secret)) if secret is not None else plain


def _aio_details(details: grpc.aio.ClientCallDetails, pair: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), pair)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), requests)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_aio_details(details, self._pair), requests)


def aio_channel(target: str, options: ChannelOptions = None, secret: InternalSecret | None = None) -> grpc.aio.Channel:
    """An asyncio channel to an internal service whose every call carries the secret (this process's
    unless given)."""
    secret = secret or process_secret()
    if secret is None:
        return grpc.aio.insecure_channel(target, options=options)
    pair = (METADATA_KEY, secret.header_value)
    # grpc.aio files an interceptor under one call kind only: one object per kind.
    interceptors = [_AioUnaryUnary(pair), _AioUnaryStream(pair), _AioStreamUnary(pair), _AioStreamStream(pair)]
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


# --- servers: refuse what does not carry it ---


class SecretCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks that lacks the secret, before its request is parsed."""

    def __init__(self, secret: InternalSecret, service: str) -> None:
        self._secret = secret
        self._service = service
        self._refused_since_log = 0
        self._last_log = -REFUSAL_LOG_INTERVAL_S

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        values = [value for key, value in (metadata or ()) if key == METADATA_KEY]
        return len(values) == 1 and self._secret.matches(values[0])

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if details.method.startswith(OPEN_METHOD_PREFIX) or self.authorized(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        return self._refusal(details.method, handler)

    def _refusal(self, method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            self._log_refusal(method, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL_DETAILS)

        # Same call shape as the real method (an unknown one is refused as unary); no deserializer, so
        # nothing an unauthenticated caller sent is parsed.
        streaming_in = bool(handler and handler.request_streaming)
        streaming_out = bool(handler and handler.response_streaming)
        if streaming_in and streaming_out:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if streaming_in:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if streaming_out:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)

    def _log_refusal(self, method: str, peer: str) -> None:
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._last_log >= REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "%s: refused %d call(s) without the internal secret (last: %s from %s)",
                self._service,
                self._refused_since_log,
                method,
                peer,
            )
            self._refused_since_log, self._last_log = 0, now


def server_interceptors(secret: InternalSecret | None, service: str) -> list[grpc.aio.ServerInterceptor]:
    """What an internal grpc.aio server needs: the secret check, or nothing when auth is off."""
    return [SecretCheck(secret, service)] if secret is not None else []

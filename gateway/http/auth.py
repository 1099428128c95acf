"""API keys: a key file that stores only hashes, the check of a request's credentials, and the policy for
running without keys.

Key file (JSON, or YAML when the name ends in .yaml/.yml), written with mode 0600:

    {"keys": [{"id": "key_3f9a1c2b7d4e", "name": "alice", "hash": "<sha256 hex>",
               "models": ["*"], "created_at": "2026-01-01T12:00:00+00:00"},
              {"id": "key_8e21d0c4a97b", "name": "prometheus", "hash": "<sha256 hex>",
               "models": [], "scopes": ["metrics"], "created_at": "2026-01-02T09:30:00+00:00"}]}

A key's scopes: `models` (names, or "*" for every model; a name covers every name of the model it names, so
"default" and the served name are one scope), and `scopes` for what is not a model: "metrics" reads GET /metrics.
"*" is every model, not every scope: an inference key does not see the whole gateway's traffic.

`hash` is the SHA-256 hex digest of the whole secret ("kvs-" + 40 URL-safe characters). Secrets are 240
random bits, so they cannot be guessed from the hash. A salt or a slow hash only helps with passwords that
people choose, so neither is used. An unsalted digest also lets a request's key be compared with every
entry in the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml

from contracts.address import is_loopback
from contracts.config import KvServeConfig

SECRET_PREFIX = "kvs-"
_SECRET_CHARS = 40
ALL_MODELS = "*"
METRICS_SCOPE = "metrics"
SCOPES = (METRICS_SCOPE,)  # the scopes that are not models

AuthMode = Literal["keys", "open-local"]


class AuthError(Exception):
    """A request's credentials are missing, malformed or unknown (HTTP 401, authentication_error)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class KeyFileError(Exception):
    """The key file cannot be read or is malformed (a startup error, or a CLI error)."""


class AuthConfigError(Exception):
    """The gateway may not start with this auth setup."""


@dataclass(frozen=True)
class KeyEntry:
    id: str
    name: str
    hash: str
    models: tuple[str, ...]
    created_at: str
    scopes: tuple[str, ...] = ()

    def allows(self, model: str, names_of_model: Collection[str] = ()) -> bool:
        """Whether the key may use `model`; names_of_model: every name of the model it names (its served name
        and aliases), so that a key scoped to one of them may use them all."""
        if ALL_MODELS in self.models or model in self.models:
            return True
        return model in names_of_model and any(name in names_of_model for name in self.models)

    @property
    def reads_metrics(self) -> bool:
        return METRICS_SCOPE in self.scopes

    def to_json(self) -> dict[str, Any]:
        entry = asdict(self)
        entry["models"] = list(self.models)
        del entry["scopes"]
        if self.scopes:  # written only when there are any: files of keys without them read as before
            entry["scopes"] = list(self.scopes)
        return entry


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_secret() -> str:
    # token_urlsafe(30) is 40 characters from [A-Za-z0-9_-]: 240 random bits.
    return SECRET_PREFIX + secrets.token_urlsafe(_SECRET_CHARS * 3 // 4)


class KeyStore:
    def __init__(self, entries: Sequence[KeyEntry]) -> None:
        self.entries: tuple[KeyEntry, ...] = tuple(entries)

    @classmethod
    def load(cls, path: str | Path) -> KeyStore:
        """Read a key file; a missing or malformed file raises KeyFileError naming the file and the problem."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KeyFileError(f"API key file not found: {path}") from None
        except OSError as exc:
            raise KeyFileError(f"cannot read API key file {path}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise KeyFileError(f"API key file {path} is not valid UTF-8: {exc}") from None
        try:
            document = yaml.safe_load(text) if _is_yaml(path) else json.loads(text)
        except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise KeyFileError(
                f"API key file {path} is not valid {'YAML' if _is_yaml(path) else 'JSON'}: {exc}"
            ) from None
        if document is None:  # an empty file: no keys yet
            return cls([])
        if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
            raise KeyFileError(f"API key file {path}: expected an object with a 'keys' list")
        return cls([_parse_entry(path, index, raw) for index, raw in enumerate(document["keys"])])

    def authenticate(self, x_api_key: str | None, authorization: str | None) -> KeyEntry:
        """The key entry for a request's x-api-key and/or Authorization: Bearer header, or AuthError."""
        presented = _presented_secret(x_api_key, authorization)
        presented_hash = hash_secret(presented).encode("ascii")
        match: KeyEntry | None = None
        # Every entry is compared (no early exit), so the time taken does not depend on which entry matches.
        for entry in self.entries:
            if hmac.compare_digest(presented_hash, entry.hash.encode("ascii")):
                match = entry
        if match is None:
            raise AuthError("invalid API key")
        return match


def create_key(path: str | Path, name: str, models: Sequence[str], scopes: Sequence[str] = ()) -> str:
    """Add a key to the file at `path` (created if missing) and return its secret, which is stored nowhere.
    `models` may be empty for a key that has only `scopes` (such as a metrics scraper's)."""
    path = Path(path)
    name = name.strip()
    if not name:
        raise ValueError("a key needs a non-empty name")
    models = [model.strip() for model in models if model.strip()]
    scopes = list(dict.fromkeys(scope.strip() for scope in scopes if scope.strip()))
    unknown = [scope for scope in scopes if scope not in SCOPES]
    if unknown:
        raise ValueError(f"unknown scope {unknown[0]!r}: the scopes are {', '.join(SCOPES)}")
    if not models and not scopes:
        raise ValueError("a key needs at least one model name, or '*' for all models, or a scope such as metrics")
    store = KeyStore.load(path) if path.exists() else KeyStore([])
    secret = new_secret()
    entry = KeyEntry(
        id=_new_key_id({entry.id for entry in store.entries}),
        name=name,
        hash=hash_secret(secret),
        models=tuple(models),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        scopes=tuple(scopes),
    )
    document = {"keys": [existing.to_json() for existing in (*store.entries, entry)]}
    _write_atomically(path, _dump(path, document))
    return secret


def revoke_key(path: str | Path, key: str) -> KeyEntry:
    """Remove the key whose id is `key` (or whose name is, when one key has it) from the file and return it.
    A running gateway refuses it from its next request (it re-reads the file when it changes)."""
    path = Path(path)
    store = KeyStore.load(path)
    matches = [entry for entry in store.entries if entry.id == key]
    if not matches:
        matches = [entry for entry in store.entries if entry.name == key]
    if not matches:
        raise KeyFileError(f"no key with id or name {key!r} in {path}")
    if len(matches) > 1:
        ids = ", ".join(entry.id for entry in matches)
        raise KeyFileError(f"{len(matches)} keys are named {key!r} in {path} ({ids}): revoke one by its id")
    revoked = matches[0]
    document = {"keys": [entry.to_json() for entry in store.entries if entry is not revoked]}
    _write_atomically(path, _dump(path, document))
    return revoked


def auth_mode(config: KvServeConfig) -> AuthMode:
    """'keys' when an api_keys_file is set; without one, 'open-local' if the gateway binds to loopback only,
    else AuthConfigError: an open gateway on a reachable address would serve anyone."""
    if config.api_keys_file:
        return "keys"
    if is_loopback(config.gateway_host):
        return "open-local"
    raise AuthConfigError(
        f"refusing to start: gateway_host={config.gateway_host!r} is reachable from other machines and no "
        "api_keys_file is set. Create a key with `kvserve keys create --name NAME --file PATH` and set "
        "api_keys_file (KVSERVE_API_KEYS_FILE=PATH), or bind to 127.0.0.1."
    )


def open_local_warning(config: KvServeConfig) -> str:
    """The line the gateway logs (level WARNING) at start in open-local mode."""
    return (
        f"API keys are OFF: no api_keys_file is set, so the gateway on {config.gateway_host}:{config.gateway_port} "
        "accepts every request (allowed because it listens on loopback only; any local user or process can use "
        "it). To require keys: `kvserve keys create --name NAME --file PATH`, then set KVSERVE_API_KEYS_FILE=PATH."
    )


def _presented_secret(x_api_key: str | None, authorization: str | None) -> str:
    api_key = (x_api_key or "").strip()
    bearer = ""
    if authorization is not None and authorization.strip():
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or " " in token:
            raise AuthError("malformed Authorization header: expected 'Authorization: Bearer <key>'")
        bearer = token
    if not api_key and not bearer:
        raise AuthError("missing API key: send it as x-api-key or as Authorization: Bearer")
    # Claude Code sends both when ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN are set; differing ones are a mistake.
    if api_key and bearer and not hmac.compare_digest(api_key.encode(), bearer.encode()):
        raise AuthError("x-api-key and Authorization: Bearer carry different keys; send one, or the same in both")
    return api_key or bearer


def _parse_entry(path: Path, index: int, raw: Any) -> KeyEntry:
    where = f"API key file {path}, key #{index}"
    if not isinstance(raw, dict):
        raise KeyFileError(f"{where}: expected an object")
    for field in ("id", "name", "hash", "created_at"):
        if not isinstance(raw.get(field), str) or not raw[field]:
            raise KeyFileError(f"{where}: '{field}' must be a non-empty string")
    digest = raw["hash"]
    if len(digest) != 64 or any(char not in "0123456789abcdef" for char in digest):
        raise KeyFileError(f"{where} ({raw['id']}): 'hash' must be a lowercase sha256 hex digest")
    models = raw.get("models")
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise KeyFileError(f"{where} ({raw['id']}): 'models' must be a list of names or ['*']")
    scopes = raw.get("scopes", [])
    if not isinstance(scopes, list) or not all(scope in SCOPES for scope in scopes):
        raise KeyFileError(f"{where} ({raw['id']}): 'scopes' must be a list of {', '.join(SCOPES)}")
    if not models and not scopes:
        raise KeyFileError(f"{where} ({raw['id']}): a key needs 'models' (names, or ['*']) or 'scopes'")
    return KeyEntry(raw["id"], raw["name"], digest, tuple(models), raw["created_at"], tuple(scopes))


def _new_key_id(taken: set[str]) -> str:
    while True:
        key_id = "key_" + secrets.token_hex(6)
        if key_id not in taken:
            return key_id


def _is_yaml(path: Path) -> bool:
    return path.suffix.lower() in (".yaml", ".yml")


def _dump(path: Path, document: dict[str, Any]) -> str:
    if _is_yaml(path):
        return yaml.safe_dump(document, sort_keys=False)
    return json.dumps(document, indent=2) + "\n"


def _write_atomically(path: Path, text: str) -> None:
    """Write via a 0600 temporary file in the same directory and rename it over `path`, so a reader sees the old
    file or the new one, never half of one."""
    directory = path.parent if str(path.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

"""API keys: the key file holds only hashes, every 401 case, model and metrics scopes, the open-local policy, and
`kvserve keys create/list/revoke` as real subprocesses, and the gateway's view of the file following its changes."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from service_processes import service_env

from contracts.address import is_loopback
from contracts.config import KvServeConfig
from gateway.http.auth import (
    AuthConfigError,
    AuthError,
    KeyFileError,
    KeyStore,
    auth_mode,
    create_key,
    hash_secret,
    open_local_warning,
    revoke_key,
)
from gateway.http.live_keys import LiveKeyStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    return tmp_path / "keys.json"


@pytest.fixture
def secrets_by_name(key_file: Path) -> dict[str, str]:
    return {
        "all": create_key(key_file, "all", ["*"]),
        "two": create_key(key_file, "two", ["small", "big"]),
    }


def test_secret_shape_and_file_holds_only_hashes(key_file: Path, secrets_by_name: dict[str, str]) -> None:
    text = key_file.read_text()
    for secret in secrets_by_name.values():
        assert secret.startswith("kvs-") and len(secret) == 44
        assert secret not in text
        assert secret.removeprefix("kvs-") not in text
        assert hash_secret(secret) in text
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    entries = json.loads(text)["keys"]
    assert [entry["name"] for entry in entries] == ["all", "two"]
    assert set(entries[0]) == {"id", "name", "hash", "models", "created_at"}
    assert len({entry["id"] for entry in entries}) == 2
    assert list(key_file.parent.iterdir()) == [key_file]  # no temporary file left behind


def test_yaml_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    secret = create_key(path, "ops", ["m"])
    assert secret not in path.read_text()
    assert KeyStore.load(path).authenticate(secret, None).name == "ops"


def test_x_api_key_and_bearer_accepted(key_file: Path, secrets_by_name: dict[str, str]) -> None:
    store = KeyStore.load(key_file)
    secret = secrets_by_name["two"]
    assert store.authenticate(secret, None).name == "two"
    assert store.authenticate(None, f"Bearer {secret}").name == "two"
    assert store.authenticate(None, f"bearer   {secret}  ").name == "two"  # the scheme is case-insensitive
    assert store.authenticate(secret, f"Bearer {secret}").name == "two"  # both, the same key
    assert store.authenticate(secrets_by_name["all"], None).name == "all"


@pytest.mark.parametrize(
    ("x_api_key", "authorization", "message"),
    [
        (None, None, "missing API key"),
        ("", "", "missing API key"),
        ("   ", None, "missing API key"),
        ("kvs-unknown", None, "invalid API key"),
        (None, "Bearer kvs-unknown", "invalid API key"),
        (None, "Basic dXNlcjpwYXNz", "malformed Authorization"),
        (None, "Bearer", "malformed Authorization"),
        (None, "Bearer ", "malformed Authorization"),
        (None, "Bearer a b", "malformed Authorization"),
        (None, "kvs-just-the-key", "malformed Authorization"),
    ],
)
def test_401_cases(
    key_file: Path, secrets_by_name: dict[str, str], x_api_key: str | None, authorization: str | None, message: str
) -> None:
    with pytest.raises(AuthError, match=message):
        KeyStore.load(key_file).authenticate(x_api_key, authorization)


def test_different_x_api_key_and_bearer_is_401_even_when_both_are_valid(
    key_file: Path, secrets_by_name: dict[str, str]
) -> None:
    store = KeyStore.load(key_file)
    with pytest.raises(AuthError, match="different keys"):
        store.authenticate(secrets_by_name["all"], f"Bearer {secrets_by_name['two']}")
    with pytest.raises(AuthError, match="malformed"):  # a malformed header is not ignored because x-api-key is fine
        store.authenticate(secrets_by_name["all"], "Token abc")


def test_near_miss_keys_are_rejected(key_file: Path, secrets_by_name: dict[str, str]) -> None:
    store = KeyStore.load(key_file)
    secret = secrets_by_name["all"]
    last = secret[-1]
    near_misses = [
        secret[:-1] + ("A" if last != "A" else "B"),  # last character differs
        ("X" if secret[4] != "X" else "Y").join((secret[:4], secret[5:])),  # first random character differs
        secret[:-1],  # one short
        secret + "A",  # one long
        secret.upper(),
        secret.removeprefix("kvs-"),
        hash_secret(secret),  # the stored hash is not a credential
    ]
    for candidate in near_misses:
        assert candidate != secret
        with pytest.raises(AuthError, match="invalid API key"):
            store.authenticate(candidate, None)


def test_allowed_models(key_file: Path, secrets_by_name: dict[str, str]) -> None:
    store = KeyStore.load(key_file)
    everything = store.authenticate(secrets_by_name["all"], None)
    assert everything.allows("small") and everything.allows("anything")
    two = store.authenticate(secrets_by_name["two"], None)
    assert two.allows("small") and two.allows("big")
    assert not two.allows("other") and not two.allows("*") and not two.allows("")


SERVED_NAMES = ("SmolLM2-135M-Instruct", "my-deployment", "default")  # a served model's names, as ServedModel's


@pytest.mark.parametrize("scope", SERVED_NAMES)
def test_a_model_scope_covers_every_name_of_that_model(key_file: Path, scope: str) -> None:
    secret = create_key(key_file, "one", [scope])
    entry = KeyStore.load(key_file).authenticate(secret, None)
    for name in SERVED_NAMES:
        assert entry.allows(name, SERVED_NAMES), (scope, name)
    assert not entry.allows("another-model", SERVED_NAMES)
    assert not entry.allows("*", SERVED_NAMES) and not entry.allows("", SERVED_NAMES)
    assert entry.allows(scope) and not entry.allows(next(name for name in SERVED_NAMES if name != scope))


def test_a_key_for_another_model_is_not_widened_by_the_served_names(key_file: Path) -> None:
    secret = create_key(key_file, "other", ["another-model"])
    entry = KeyStore.load(key_file).authenticate(secret, None)
    assert not any(entry.allows(name, SERVED_NAMES) for name in SERVED_NAMES)
    assert entry.allows("another-model", SERVED_NAMES)


def test_metrics_is_a_scope_of_its_own(key_file: Path) -> None:
    every_model = create_key(key_file, "every-model", ["*"])
    scraper = create_key(key_file, "scraper", [], ["metrics"])
    both = create_key(key_file, "both", ["default"], ["metrics"])
    store = KeyStore.load(key_file)
    assert not store.authenticate(every_model, None).reads_metrics  # '*' is every model, not every scope
    assert store.authenticate(scraper, None).reads_metrics and not store.authenticate(scraper, None).allows("default")
    assert store.authenticate(both, None).reads_metrics and store.authenticate(both, None).allows("default")
    entries = json.loads(key_file.read_text())["keys"]
    assert "scopes" not in entries[0]  # written only when a key has any: older gateways read such files as before
    assert entries[1]["models"] == [] and entries[1]["scopes"] == ["metrics"]
    with pytest.raises(ValueError, match="unknown scope 'admin'"):
        create_key(key_file, "x", ["*"], ["admin"])
    with pytest.raises(ValueError, match="scope"):
        create_key(key_file, "x", [], [])
    assert len(KeyStore.load(key_file).entries) == 3


def test_create_key_rejects_empty_name_or_models(key_file: Path) -> None:
    with pytest.raises(ValueError, match="name"):
        create_key(key_file, " ", ["*"])
    with pytest.raises(ValueError, match="model"):
        create_key(key_file, "x", [" "])
    assert not key_file.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"keys": {}}', "'keys' list"),
        ('{"keys": [{"id": "k", "name": "n", "hash": "abc", "models": ["*"], "created_at": "t"}]}', "sha256"),
        ('{"keys": [{"id": "k", "name": "n", "hash": "' + "a" * 64 + '", "models": [], "created_at": "t"}]}', "models"),
        ('{"keys": [{"name": "n"}]}', "'id'"),
        (
            '{"keys": [{"id": "k", "name": "n", "hash": "' + "a" * 64 + '", "models": [], "scopes": ["admin"], '
            '"created_at": "t"}]}',
            "'scopes'",
        ),
        (
            '{"keys": [{"id": "k", "name": "n", "hash": "' + "a" * 64 + '", "models": [], "scopes": [], '
            '"created_at": "t"}]}',
            "'models'",
        ),
        ("[" * 100_000, "not valid JSON"),  # nested too deep for the parser
    ],
)
def test_malformed_key_file(key_file: Path, content: str, message: str) -> None:
    key_file.write_text(content)
    with pytest.raises(KeyFileError, match=message):
        KeyStore.load(key_file)


def test_key_file_that_is_not_utf8(key_file: Path) -> None:
    create_key(key_file, "ops", ["*"])
    key_file.write_bytes(b"\xff\xfe" + key_file.read_bytes())
    with pytest.raises(KeyFileError, match=f"{key_file} is not valid UTF-8"):
        KeyStore.load(key_file)


def test_missing_key_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="not found"):
        KeyStore.load(tmp_path / "absent.json")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "LOCALHOST", "127.0.0.2"])
def test_open_local_on_loopback(host: str) -> None:
    assert is_loopback(host)
    config = KvServeConfig(gateway_host=host, api_keys_file="")
    assert auth_mode(config) == "open-local"
    assert "API keys are OFF" in open_local_warning(config)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com", "localhost.example.com", ""])
def test_no_keys_on_a_reachable_address_is_a_startup_error(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(AuthConfigError, match="api_keys_file"):
        auth_mode(KvServeConfig(gateway_host=host, api_keys_file=""))


def test_keys_mode_when_a_key_file_is_set() -> None:
    assert auth_mode(KvServeConfig(gateway_host="0.0.0.0", api_keys_file="/etc/kvserve/keys.json")) == "keys"
    assert auth_mode(KvServeConfig(gateway_host="127.0.0.1", api_keys_file="/etc/kvserve/keys.json")) == "keys"


def kvserve(*args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=ROOT,
        env=service_env(**settings),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_create_prints_the_secret_once_and_list_never_shows_it(key_file: Path) -> None:
    created = kvserve("keys", "create", "--name", "ci-bot", "--models", "small,big", "--file", str(key_file))
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert secret.startswith("kvs-") and created.stdout == secret + "\n"
    assert (created.stdout + created.stderr).count(secret) == 1
    assert "cannot be recovered" in created.stderr
    assert secret not in key_file.read_text()
    entry = KeyStore.load(key_file).authenticate(None, f"Bearer {secret}")
    assert entry.name == "ci-bot" and entry.models == ("small", "big")

    listed = kvserve("keys", "list", "--file", str(key_file))
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["ID", "NAME", "MODELS", "SCOPES", "CREATED"]
    assert row.split() == [entry.id, "ci-bot", "small,big", "-", entry.created_at]
    assert secret not in listed.stdout + listed.stderr
    assert entry.hash not in listed.stdout + listed.stderr


def test_cli_default_file_comes_from_the_config(tmp_path: Path) -> None:
    path = tmp_path / "from-env.json"
    created = kvserve("keys", "create", "--name", "env", KVSERVE_API_KEYS_FILE=str(path))
    assert created.returncode == 0, created.stderr
    assert KeyStore.load(path).authenticate(created.stdout.strip(), None).models == ("*",)


def test_cli_errors(tmp_path: Path) -> None:
    missing = kvserve("keys", "list", "--file", str(tmp_path / "absent.json"))
    assert missing.returncode == 1 and "not found" in missing.stderr
    mixed = kvserve("keys", "create", "--name", "x", "--models", "a,*", "--file", str(tmp_path / "k.json"))
    assert mixed.returncode == 1 and "'*'" in mixed.stderr and not mixed.stdout
    no_name = kvserve("keys", "create", "--file", str(tmp_path / "k.json"))
    assert no_name.returncode == 2 and "--name" in no_name.stderr


def test_revoke_by_id_or_unique_name(key_file: Path, secrets_by_name: dict[str, str]) -> None:
    store = KeyStore.load(key_file)
    two = store.authenticate(secrets_by_name["two"], None)
    assert revoke_key(key_file, two.id) == two
    remaining = KeyStore.load(key_file)
    with pytest.raises(AuthError):
        remaining.authenticate(secrets_by_name["two"], None)
    assert remaining.authenticate(secrets_by_name["all"], None).name == "all"
    assert revoke_key(key_file, "all").name == "all"
    assert KeyStore.load(key_file).entries == ()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_revoke_refuses_unknown_and_ambiguous_names(key_file: Path) -> None:
    create_key(key_file, "twin", ["*"])
    create_key(key_file, "twin", ["*"])
    with pytest.raises(KeyFileError, match="no key with id or name 'nobody'"):
        revoke_key(key_file, "nobody")
    with pytest.raises(KeyFileError, match=r"2 keys are named 'twin'.*by its id"):
        revoke_key(key_file, "twin")
    assert len(KeyStore.load(key_file).entries) == 2  # nothing removed


def test_live_key_store_follows_the_file(key_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = create_key(key_file, "first", ["*"])
    live = LiveKeyStore(key_file)
    assert live.authenticate(first, None).name == "first"
    second = create_key(key_file, "second", ["*"])
    assert live.authenticate(second, None).name == "second"  # created after the store was loaded
    revoke_key(key_file, "first")
    with pytest.raises(AuthError):
        live.authenticate(first, None)
    key_file.write_text("{not json")  # a hand edit gone wrong: the keys last read stay in use, loudly
    assert live.authenticate(second, None).name == "second"
    assert "is not valid JSON" in caplog.text and "still using the 1 keys" in caplog.text


@pytest.mark.parametrize("bad", [b"\xff\xfe{}", b'{"keys": [{"name": "caf\xe9"}]}'], ids=["bom-like", "latin-1"])
def test_live_key_store_keeps_the_last_good_keys_on_bytes_that_are_not_utf8(
    key_file: Path, caplog: pytest.LogCaptureFixture, bad: bytes
) -> None:
    secret = create_key(key_file, "kept", ["*"])
    live = LiveKeyStore(key_file)
    key_file.write_bytes(bad)  # a hand edit in another encoding: handled as bad JSON is, not a 500 on every request
    assert live.authenticate(secret, None).name == "kept"
    assert "is not valid UTF-8" in caplog.text and "still using the 1 keys" in caplog.text
    assert [record.levelname for record in caplog.records] == ["ERROR"]


def test_cli_revoke(key_file: Path) -> None:
    created = kvserve("keys", "create", "--name", "leaving", "--file", str(key_file))
    secret = created.stdout.strip()
    key_id = KeyStore.load(key_file).authenticate(secret, None).id
    revoked = kvserve("keys", "revoke", key_id, "--file", str(key_file))
    assert revoked.returncode == 0, revoked.stderr
    assert key_id in revoked.stderr and "'leaving'" in revoked.stderr and not revoked.stdout
    assert KeyStore.load(key_file).entries == ()
    again = kvserve("keys", "revoke", key_id, "--file", str(key_file))
    assert again.returncode == 1 and "no key with id or name" in again.stderr

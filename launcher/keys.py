"""`kvserve keys create`, `list` and `revoke`: manage the gateway's API key file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from gateway.http.auth import ALL_MODELS, METRICS_SCOPE, KeyFileError, KeyStore, create_key, revoke_key

DEFAULT_KEYS_FILE = "kvserve-keys.json"


def keys_file(file: str | None, config_file: str | None) -> Path:
    """--file, else the config's api_keys_file, else ./kvserve-keys.json."""
    if file:
        return Path(file)
    from contracts.config import load_config

    return Path(load_config(config_file).api_keys_file or DEFAULT_KEYS_FILE)


def parse_models(spec: str | None, metrics: bool = False) -> list[str]:
    """'*' -> ['*'] (every model), 'a,b' -> ['a', 'b']; not given: every model, or none for a --metrics key
    (a scraper's key then cannot run inference; give --models as well for both)."""
    if spec is None:
        return [] if metrics else [ALL_MODELS]
    models = [model.strip() for model in spec.split(",") if model.strip()]
    if not models and not metrics:
        raise ValueError("--models needs model names separated by commas, or '*' for all models")
    if ALL_MODELS in models and len(models) > 1:
        raise ValueError("--models: '*' already allows every model; give it alone")
    return models


def create_command(
    path: Path,
    name: str,
    models_spec: str | None,
    metrics: bool = False,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    try:
        models = parse_models(models_spec, metrics)
        secret = create_key(path, name, models, [METRICS_SCOPE] if metrics else [])
    except (ValueError, KeyFileError, OSError) as exc:
        print(f"error: {exc}", file=err)
        return 1
    # The secret alone goes to stdout, so `KEY=$(kvserve keys create ...)` captures just the key.
    print(secret, file=out)
    allowed = [f"models {','.join(models)}"] if models else []
    allowed += ["GET /metrics"] if metrics else []
    print(
        f"created API key {name!r} for {' and '.join(allowed)} in {path}.\n"
        "This is the only time the key is shown: it is stored as a hash and cannot be recovered.\n"
        f"The gateway uses the file when api_keys_file names it (KVSERVE_API_KEYS_FILE={path.resolve()}).",
        file=err,
    )
    return 0


def list_command(path: Path, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    try:
        store = KeyStore.load(path)
    except KeyFileError as exc:
        print(f"error: {exc}", file=err)
        return 1
    if not store.entries:
        print(f"no keys in {path}", file=err)
        return 0
    rows = [("ID", "NAME", "MODELS", "SCOPES", "CREATED")]
    rows += [
        (entry.id, entry.name, ",".join(entry.models) or "-", ",".join(entry.scopes) or "-", entry.created_at)
        for entry in store.entries
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    for row in rows:
        padded = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
        print("  ".join([*padded, row[4]]), file=out)
    return 0


def revoke_command(path: Path, key: str, err: TextIO = sys.stderr) -> int:
    try:
        revoked = revoke_key(path, key)
    except (KeyFileError, OSError) as exc:
        print(f"error: {exc}", file=err)
        return 1
    print(
        f"revoked API key {revoked.id} ({revoked.name!r}) in {path}; a gateway using this file refuses it from "
        "its next request",
        file=err,
    )
    return 0

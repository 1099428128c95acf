"""The router's Redis password: read from a file (redis_password_file), never written in a config URL, and
put into the connection URL only in memory (DurableState logs the URL redacted)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path


class RedisPasswordError(ValueError):
    """The password file cannot be read or is empty."""


def read_redis_password(path: str | Path) -> str:
    try:
        password = Path(path).read_text().strip()
    except OSError as exc:
        raise RedisPasswordError(f"cannot read redis_password_file {path}: {exc.strerror or exc}") from exc
    if not password:
        raise RedisPasswordError(f"redis_password_file {path} is empty")
    return password


def redis_url_with_password(url: str, password_file: str) -> str:
    """`url` with the password from `password_file` (which wins over one in the URL); `url` unchanged when
    no file is configured."""
    if not password_file:
        return url
    password = urllib.parse.quote(read_redis_password(password_file), safe="")
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    netloc = f"{urllib.parse.quote(parts.username or '', safe='')}:{password}@{host}{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

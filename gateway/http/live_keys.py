"""The API key file as the gateway uses it: re-read when it changes on disk, so that keys created or revoked
with `kvserve keys` apply from the next request, without a restart. A stat per request (microseconds) rather
than a watcher thread: nothing to start or stop, and no window in which a revoked key still works."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gateway.http.auth import KeyEntry, KeyFileError, KeyStore

log = logging.getLogger(__name__)

FileSignature = tuple[int, int, int] | None  # inode, mtime (ns), size; None: the file is not there


class LiveKeyStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._signature = _signature(self.path)
        self._store = KeyStore.load(self.path)  # at start, a missing or malformed file is an error

    @property
    def entries(self) -> tuple[KeyEntry, ...]:
        self._reload_if_changed()
        return self._store.entries

    def authenticate(self, x_api_key: str | None, authorization: str | None) -> KeyEntry:
        """As KeyStore.authenticate, against the file as it is now."""
        self._reload_if_changed()
        return self._store.authenticate(x_api_key, authorization)

    def _reload_if_changed(self) -> None:
        signature = _signature(self.path)
        if signature == self._signature:
            return
        self._signature = signature
        try:
            store = KeyStore.load(self.path)
        except KeyFileError as exc:
            # `kvserve keys` replaces the file atomically, so this is a hand edit gone wrong: keep serving the
            # keys last read (refusing everyone would take the service down) and say so loudly.
            log.error("%s; still using the %d keys read before", exc, len(self._store.entries))
            return
        log.info("API key file %s changed: %d keys (was %d)", self.path, len(store.entries), len(self._store.entries))
        self._store = store


def _signature(path: Path) -> FileSignature:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    # The inode changes on every atomic replace, even within one mtime tick.
    return stat.st_ino, stat.st_mtime_ns, stat.st_size

"""A thread that follows the kvstore's KV event stream: it keeps the rank's L1View, and tells the tier when
the kvstore went away (the stream ended or broke, and the arena the rank maps is no longer current) or is
there again (a stream opened), so an idle rank unmaps a dead arena at once and attaches to the new one
without waiting for its next request.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

from rank_worker.l1.kvstore_client import KvEventStream, KvStoreClient, L1UnavailableError
from rank_worker.l1.l1_view import L1View

log = logging.getLogger(__name__)


class KvStoreNews(enum.Enum):
    UP = "up"  # a subscription opened: the kvstore answers
    LOST = "lost"  # the stream ended and the arena last reported mapped is not the kvstore's any more


class KvStoreWatch:
    def __init__(
        self,
        client: KvStoreClient,
        view: L1View,
        on_news: Callable[[KvStoreNews], None],
        retry_interval_s: float = 0.5,
    ) -> None:
        self.client = client
        self.view = view
        self.mapped_arena_id = ""  # set by the tier: the arena it maps now ("" = none)
        self._on_news = on_news
        self._retry_interval_s = retry_interval_s
        self._stopping = threading.Event()
        self._stream: KvEventStream | None = None
        self._thread = threading.Thread(target=self._run, name="l1-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            opened = self._follow()
            if self._stopping.is_set():
                break
            if opened:
                self.view.clear()  # a restarted kvstore comes back empty; the next snapshot refills it
                if not self._arena_still_current():
                    self._on_news(KvStoreNews.LOST)
            self._stopping.wait(self._retry_interval_s)

    def _follow(self) -> bool:
        """Apply one subscription's batches until it ends; True if it delivered any."""
        opened = False
        try:
            stream = self.client.kv_events()
            self._stream = stream
            if self._stopping.is_set():
                return False
            expected = 1
            for batch in stream:
                if batch.sequence != expected:  # batches were dropped: start over from a new snapshot
                    log.info("L1 events: expected batch %d, got %d; subscribing again", expected, batch.sequence)
                    stream.cancel()
                    break
                expected += 1
                self.view.apply(batch.events)
                if not opened:
                    opened = True
                    self._on_news(KvStoreNews.UP)
        except L1UnavailableError as exc:
            log.debug("L1 event stream: %s", exc)
        except Exception:  # the watch must outlive any surprise; the tier still works without it
            log.exception("L1 event stream failed")
        finally:
            self._stream = None
        return opened

    def _arena_still_current(self) -> bool:
        mapped = self.mapped_arena_id
        if not mapped:
            return True  # nothing mapped: nothing to let go of
        try:
            return self.client.current_arena_id() == mapped
        except L1UnavailableError:
            return False  # gone (or unreachable): the arena it left behind must not stay mapped

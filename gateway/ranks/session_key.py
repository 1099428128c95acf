"""The session id as the router and the ranks see it. Clients choose session ids (a header, metadata.user_id,
OpenAI's `user`); the router keeps them as Redis keys and log fields and refuses ids that are long or carry
unprintable characters. Such ids are replaced by a digest here, so their requests still route, and stick:
the same id always gives the same digest."""

from __future__ import annotations

import hashlib

from contracts.ids import MAX_ID_CHARS

DIGEST_PREFIX = "digest:"


def routing_session_id(session_id: str) -> str:
    """`session_id` itself when the router takes it as it is, else a fixed-size printable digest of it."""
    if len(session_id) <= MAX_ID_CHARS and session_id.isprintable():
        return session_id
    # surrogatepass: a lone surrogate (from JSON "\ud800") is still a distinct, stable id
    digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return DIGEST_PREFIX + digest

"""The ids services pass each other (rank, incarnation, request and session ids): the router keeps them as Redis
keys and the kvstore as pin owners, and every service writes them into log fields, so each has a bounded length.
"""

from __future__ import annotations

MAX_ID_CHARS = 256  # the router and the kvstore refuse a longer id; the gateway digests a longer session id

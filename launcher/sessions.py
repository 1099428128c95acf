"""`kvserve sessions`: the router's per-session view (router.proto ListSessions), newest first: each session's
calls, prompt tokens from L0, from L1 and computed, cache hit, cold prefills and its rank.

The router is the config's `router` (else router_host:router_port), or --target; the call carries the internal
secret as `kvserve complete` does (--secret-file, the config's internal_secret_file, or `kvserve up`'s)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from contracts import internal_auth
from protos import router_pb2 as pb
from protos import router_pb2_grpc as pb_grpc

LIST_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # every session of a full view, with the longest ids (~6 MB)
PIPE_WIDTH = 160
SESSION_ID_WIDTH = 36  # a UUID, as Claude Code's session ids are


def list_sessions(
    target: str, limit: int, secret: internal_auth.InternalSecret | None = None
) -> pb.ListSessionsResponse:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with internal_auth.channel(target, options=options, secret=secret) as channel:
        return pb_grpc.RouterStub(channel).ListSessions(pb.ListSessionsRequest(limit=limit), timeout=LIST_TIMEOUT_S)


def session_dict(stats: pb.SessionStats) -> dict[str, Any]:
    """One session as --json prints it."""
    return {
        "session_id": stats.session_id,
        "rank_id": stats.rank_id,
        "calls": stats.calls,
        "prompt_tokens": stats.prompt_tokens,
        "l0_cached_tokens": stats.l0_cached_tokens,
        "l1_cached_tokens": stats.l1_cached_tokens,
        "computed_tokens": stats.computed_tokens,
        "output_tokens": stats.output_tokens,
        "cache_hit": round(stats.cache_hit, 4),
        "cold_prefills": stats.cold_prefills,
        "ranks_used": stats.ranks_used,
        "first_seen_unix_s": round(stats.first_seen_unix_s, 3),
        "last_seen_unix_s": round(stats.last_seen_unix_s, 3),
    }


def sessions_json(reply: pb.ListSessionsResponse) -> str:
    document = {
        "sessions": [session_dict(stats) for stats in newest_first(reply.sessions)],
        "tracked": reply.tracked,
        "warm_prefix_fraction": reply.warm_prefix_fraction,
    }
    return json.dumps(document, indent=2)


def newest_first(sessions: Any) -> list[pb.SessionStats]:
    """Sorted by last seen, newest first (the router answers in that order; this does not rely on it)."""
    return sorted(sessions, key=lambda stats: stats.last_seen_unix_s, reverse=True)


def age(seconds: float) -> str:
    """A short age: 42s, 7m, 3h, 2d."""
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def short_id(session_id: str, width: int = SESSION_ID_WIDTH + 12) -> str:
    return session_id if len(session_id) <= width else session_id[: width - 1] + "…"


def sessions_table(reply: pb.ListSessionsResponse, now: float) -> Table:
    shown = len(reply.sessions)
    caption = (
        f"{shown} of {reply.tracked} session(s) in the router's view, newest first; cold: calls with under "
        f"{reply.warm_prefix_fraction:.0%} of the prompt cached, first calls included"
    )
    table = Table(title="kvserve sessions", caption=caption, caption_justify="left")
    table.add_column("session", overflow="fold", min_width=SESSION_ID_WIDTH)
    table.add_column("rank")
    for name in ("calls", "prompt", "L0", "L1", "computed", "hit", "cold", "output", "last seen"):
        table.add_column(name, justify="right")
    for stats in newest_first(reply.sessions):
        rank = stats.rank_id if stats.ranks_used <= 1 else f"{stats.rank_id} (+{stats.ranks_used - 1})"
        table.add_row(
            short_id(stats.session_id),
            rank,
            f"{stats.calls:,}",
            f"{stats.prompt_tokens:,}",
            f"{stats.l0_cached_tokens:,}",
            f"{stats.l1_cached_tokens:,}",
            f"{stats.computed_tokens:,}",
            f"{stats.cache_hit:.1%}",
            f"{stats.cold_prefills:,}",
            f"{stats.output_tokens:,}",
            f"{age(now - stats.last_seen_unix_s)} ago",
        )
    return table


def print_sessions(
    reply: pb.ListSessionsResponse, as_json: bool, out: TextIO | None = None, now: float | None = None
) -> None:
    out = out if out is not None else sys.stdout
    if as_json:
        out.write(sessions_json(reply) + "\n")
        return
    console = Console(file=out)
    if not console.is_terminal:  # a pipe or a file: wide enough for whole session ids (a terminal: its width)
        console = Console(file=out, width=PIPE_WIDTH)
    if not reply.sessions:
        console.print("no sessions reported to the router yet (it counts requests that carry a session id)")
        return
    console.print(sessions_table(reply, time.time() if now is None else now))

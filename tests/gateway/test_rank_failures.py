"""Whose failure is it: the rank's (it leaves routing, the stream moves on) or the request's own (it ends
alone); whether the router is away or answered; session ids the router would refuse."""

from __future__ import annotations

import grpc
import pytest

from contracts.ids import MAX_ID_CHARS
from gateway.ranks.rank_choice import router_away_error
from gateway.ranks.rank_client import rank_at_fault
from gateway.ranks.session_key import routing_session_id

Code = grpc.StatusCode


def test_only_transport_failures_count_against_a_rank() -> None:
    assert rank_at_fault(Code.UNAVAILABLE)  # refused, reset, closed, a rank stopping
    assert rank_at_fault(Code.CANCELLED, cancelled_by_us=False)  # the rank went away
    for own in (Code.CANCELLED, Code.DEADLINE_EXCEEDED, Code.INTERNAL, Code.INVALID_ARGUMENT, Code.UNKNOWN):
        assert not rank_at_fault(own, cancelled_by_us=own == Code.CANCELLED), own


def _error(code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details="x")


def test_a_router_that_answered_is_not_away() -> None:
    assert router_away_error(_error(Code.DEADLINE_EXCEEDED))  # hung
    assert router_away_error(_error(Code.UNAVAILABLE))  # dead or unreachable
    assert not router_away_error(_error(Code.UNAVAILABLE, (("kvserve-no-rank", "1"),)))  # "no rank is left"
    assert not router_away_error(_error(Code.INVALID_ARGUMENT))  # it refused this query


@pytest.mark.parametrize("session", ["", "abc-123", "s" * MAX_ID_CHARS, "é ü 日本"])
def test_session_ids_the_router_takes_pass_unchanged(session: str) -> None:
    assert routing_session_id(session) == session


@pytest.mark.parametrize("session", ["s" * (MAX_ID_CHARS + 1), "a\x01b", "line\nbreak", "\ud800", "x" * 100_000])
def test_other_session_ids_become_a_stable_printable_digest(session: str) -> None:
    digest = routing_session_id(session)
    assert digest != session and digest.isprintable() and len(digest) <= MAX_ID_CHARS
    assert routing_session_id(session) == digest  # stickiness: the same id, the same digest
    assert routing_session_id(session + "!") != digest

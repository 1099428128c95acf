"""The in-memory session table: TTL, refresh on use, restore from Redis, purge."""

from __future__ import annotations

from router.session_table import SessionTable


def test_record_and_expire_after_idle_ttl() -> None:
    table = SessionTable(ttl_s=10)
    table.record("s", "a", now=0)
    assert table.rank_of("s", now=9.9) == "a"
    assert table.rank_of("s", now=10) is None
    assert table.rank_of("other", now=0) is None


def test_each_turn_refreshes_the_ttl_and_can_move_the_session() -> None:
    table = SessionTable(ttl_s=10)
    table.record("s", "a", now=0)
    table.record("s", "b", now=8)
    assert table.rank_of("s", now=17) == "b"


def test_restore_never_overrides_memory_and_caps_the_ttl() -> None:
    table = SessionTable(ttl_s=10)
    table.record("s", "memory", now=0)
    assert not table.restore("s", "redis", remaining_s=5, now=0)
    assert table.rank_of("s", now=1) == "memory"
    assert table.restore("t", "redis", remaining_s=500, now=0)
    assert table.rank_of("t", now=9) == "redis" and table.rank_of("t", now=10.5) is None
    assert not table.restore("u", "redis", remaining_s=0, now=0)


def test_purge_drops_expired_entries_and_live_lists_the_rest() -> None:
    table = SessionTable(ttl_s=10)
    for index in range(5):
        table.record(f"s{index}", "a", now=index)
    assert table.purge_expired(now=12.5) == 3
    assert len(table) == 2
    assert [session for session, _ in table.live(now=12.5)] == ["s3", "s4"]

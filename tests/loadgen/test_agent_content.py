"""Prompt content: same id -> same text, a turn that extends another extends its text, sizes follow the
calibration and the context scale."""

from __future__ import annotations

from loadgen.content import WORDS, ContentBuilder, block_text, block_word_count, calibration_text, turn_ends
from loadgen.reuse import SentPrefixes
from loadgen.traces import TraceTurn


def _turn(ids: range | list[int], input_tokens: int | None = None, block_tokens: int = 64) -> TraceTurn:
    ids = tuple(ids)
    size = input_tokens if input_tokens is not None else len(ids) * block_tokens
    return TraceTurn(0.0, 0.0, size, 10, ids, block_tokens)


def test_same_id_same_text_and_different_ids_differ() -> None:
    assert block_text(42, 50) == block_text(42, 50)
    assert block_text(42, 50) != block_text(43, 50)
    assert block_text(42, 50).startswith(block_text(42, 20))
    assert all(word in WORDS for word in block_text(7, 30).split())


def test_equal_turns_of_different_builders_calls_are_identical() -> None:
    builder = ContentBuilder(tokens_per_word=1.2, factor=0.5)
    turn = _turn(range(100, 140))
    assert builder.prompt(turn) == ContentBuilder(tokens_per_word=1.2, factor=0.5).prompt(turn)


def test_a_turn_extending_another_extends_its_prompt() -> None:
    builder = ContentBuilder(tokens_per_word=1.3)
    first = builder.prompt(_turn(range(1, 30), input_tokens=28 * 64 + 20))  # last block partial
    second = builder.prompt(_turn(range(1, 60)))
    assert first.system == second.system
    assert second.user.startswith(first.user) and len(second.user) > len(first.user)


def test_with_messages_a_turn_is_cut_where_the_turns_it_extends_ended() -> None:
    builder = ContentBuilder(tokens_per_word=1.3, messages=True)
    first = builder.prompt(_turn(range(1, 30)))
    second = builder.prompt(_turn(range(1, 45)), earlier=(29,))
    third = builder.prompt(_turn(range(1, 60)), earlier=(29, 44))
    assert first.user_turns == (first.user,)
    assert second.user_turns[0] == first.user and len(second.user_turns) == 2
    assert third.user_turns[:2] == second.user_turns  # earlier messages come again word for word
    assert " ".join(third.user_turns).split() == third.user.split()  # the same words as one message
    assert ContentBuilder(tokens_per_word=1.3).prompt(_turn(range(1, 60))).user_turns == ()  # the default: one message


def test_turn_ends_follow_the_turns_a_turn_extends() -> None:
    first, second, third = _turn(range(1, 30)), _turn(range(1, 45)), _turn(range(1, 60))
    assert turn_ends((), (), first) == ()
    assert turn_ends(first.hash_ids, (), second) == (29,)
    assert turn_ends(second.hash_ids, (29,), third) == (29, 44)
    assert turn_ends(third.hash_ids, (29, 44), _turn([1, 2, 99])) == ()  # the trace rewrote its context


def test_divergent_turns_share_only_their_common_blocks() -> None:
    builder = ContentBuilder(tokens_per_word=1.0)
    a = builder.prompt(_turn([1, 2, 3, 4, 5, 6]))
    b = builder.prompt(_turn([1, 2, 3, 9, 10, 11]))
    common = builder.prompt(_turn([1, 2, 3])).user
    assert a.user.startswith(common) and b.user.startswith(common)
    rest_a, rest_b = a.user[len(common) :].split(), b.user[len(common) :].split()
    assert rest_a[:3] != rest_b[:3]


def test_sizes_follow_tokens_per_word_and_factor() -> None:
    turn = _turn(range(1, 201), input_tokens=200 * 64 - 30)
    full = ContentBuilder(tokens_per_word=1.25)
    assert abs(full.expected_tokens(turn) - turn.input_tokens) <= 2
    assert abs(len((full.prompt(turn).system + " " + full.prompt(turn).user).split()) * 1.25 - turn.input_tokens) < 3
    scaled = ContentBuilder(tokens_per_word=1.25, factor=0.05)
    assert abs(scaled.expected_tokens(turn) - turn.input_tokens * 0.05) / (turn.input_tokens * 0.05) < 0.1


def test_fractional_blocks_dither_to_the_right_mean() -> None:
    counts = [block_word_count(h, 0.4) for h in range(10_000)]
    assert set(counts) == {0, 1}
    assert abs(sum(counts) / len(counts) - 0.4) < 0.02
    assert block_word_count(5, 0.4) == block_word_count(5, 0.4)


def test_calibration_text_has_the_asked_words() -> None:
    assert len(calibration_text(400).split()) == 400
    assert calibration_text(400) == calibration_text(400)


def test_sent_prefixes_measure_reuse_across_agents() -> None:
    sent = SentPrefixes()
    first = _turn(range(1, 11))
    assert sent.expected_reuse(first) == 0.0
    sent.add(first.hash_ids)
    assert sent.expected_reuse(_turn(range(1, 21))) == 0.5
    assert sent.expected_reuse(_turn([1, 2, 99])) == 2 / 3
    assert sent.expected_reuse(_turn([99, 1, 2])) == 0.0
    # A partial last block: the shared blocks can cover the whole (smaller) input, never more.
    assert sent.expected_reuse(_turn(range(1, 11), input_tokens=600)) == 1.0

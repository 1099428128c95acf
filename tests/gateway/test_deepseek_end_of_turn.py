"""DeepSeek's end-of-sentence marker written out as text (a tokenizer with no token for it) ends the turn."""

from __future__ import annotations

from gateway.prompt.deepseek_prompt import EOS
from gateway.prompt.prompt_format import PromptFormat, end_of_turn_texts
from gateway.prompt.render import ModelTemplate

DEEPSEEK = ModelTemplate(chat_template="", family="deepseek_dsml")
HERMES = ModelTemplate(chat_template="", family="hermes")


def feed_in_pieces(prompts: PromptFormat, stop: list[str], text: str, size: int) -> tuple[str, str | None]:
    matcher = prompts.stop_matcher(stop)
    shown = ""
    for start in range(0, len(text), size):
        safe, matched = matcher.feed(text[start : start + size])
        shown += safe
        if matched is not None:
            return shown, matched
    return shown + matcher.finish(), None


def test_only_a_deepseek_model_without_the_token_stops_on_the_text() -> None:
    assert end_of_turn_texts(DEEPSEEK, vocab={"a", "b"}) == (EOS,)
    assert end_of_turn_texts(DEEPSEEK, vocab={"a", EOS}) == ()  # the rank stops on the token itself
    assert end_of_turn_texts(HERMES, vocab={"a"}) == ()
    own = ModelTemplate(chat_template="", eos_token="<|end|>", family="deepseek_dsml")
    assert end_of_turn_texts(own, vocab=set()) == ("<|end|>",)  # the tokenizer's own EOS text


def test_the_reply_ends_before_the_marker_whatever_the_chunking() -> None:
    prompts = PromptFormat(DEEPSEEK, end_of_turn_texts(DEEPSEEK, vocab=set()))
    text = f"The answer is 4.{EOS}<｜User｜>and the model went on"
    for size in (1, 2, 3, 7, len(text)):
        shown, matched = feed_in_pieces(prompts, [], text, size)
        assert shown == "The answer is 4." and matched == EOS
        assert prompts.ends_turn(matched, [])  # end_turn, not stop_sequence


def test_a_client_stop_sequence_is_still_one() -> None:
    prompts = PromptFormat(DEEPSEEK, (EOS,))
    shown, matched = feed_in_pieces(prompts, ["STOP"], f"one STOP two{EOS}", 4)
    assert shown == "one " and matched == "STOP" and not prompts.ends_turn(matched, ["STOP"])
    # a client that asks for the marker itself gets it reported as its stop sequence
    shown, matched = feed_in_pieces(prompts, [EOS], f"done{EOS}", 3)
    assert shown == "done" and matched == EOS and not prompts.ends_turn(matched, [EOS])


def test_other_families_pass_the_marker_through() -> None:
    prompts = PromptFormat(HERMES, end_of_turn_texts(HERMES, vocab=set()))
    shown, matched = feed_in_pieces(prompts, [], f"a{EOS}b", 5)
    assert shown == f"a{EOS}b" and matched is None

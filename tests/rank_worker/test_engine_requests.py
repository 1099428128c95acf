"""Request semantics on the real embedded model: finish reasons, stop tokens, seeds, validation."""

from __future__ import annotations

import pytest
from engine_fixtures import generate_one, greedy, make_engine, random_prompt

from rank_worker.engine.interface import EngineRequest, FinishReason, InvalidRequestError, SamplingParams


def test_max_tokens_then_stop_token_end_the_request(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer)
    prompt = random_prompt(20, model.cfg.vocab_size, seed=1)
    out = generate_one(engine, prompt, greedy(6), "len")
    assert out.finish_reason is FinishReason.LENGTH and len(out.new_token_ids) == 6
    stop_at = out.new_token_ids[3]
    first_index = out.new_token_ids.index(stop_at)
    stopped = generate_one(engine, prompt, SamplingParams(max_tokens=6, stop_token_ids=(stop_at,)), "stop")
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_token_id == stop_at
    assert stopped.new_token_ids == out.new_token_ids[:first_index]  # the stop token itself is not content
    assert stopped.stats.output_tokens == first_index + 1


def test_eos_stops_unless_ignored(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.tokenizer_json)
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    prompt = tok.encode(chat, add_special_tokens=False).ids
    natural = generate_one(engine, prompt, greedy(64, ignore_eos=False), "natural")
    assert natural.finish_reason is FinishReason.STOP
    assert natural.stop_token_id in tokenizer.eos_token_ids
    forced = generate_one(engine, prompt, greedy(len(natural.new_token_ids) + 4, ignore_eos=True), "forced")
    assert forced.finish_reason is FinishReason.LENGTH
    assert forced.new_token_ids[: len(natural.new_token_ids)] == natural.new_token_ids


def test_seeded_sampling_is_reproducible(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer)
    prompt = random_prompt(12, model.cfg.vocab_size, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    a = generate_one(engine, prompt, params, "a").new_token_ids
    b = generate_one(engine, prompt, params, "b").new_token_ids
    c = generate_one(engine, prompt, SamplingParams(**{**params.__dict__, "seed": 99}), "c").new_token_ids
    assert a == b and a != c


def test_model_len_limit_finishes_with_length(smollm2) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer, max_model_len=40)
    out = generate_one(engine, random_prompt(30, model.cfg.vocab_size, seed=3), greedy(100))
    assert out.finish_reason is FinishReason.LENGTH and len(out.new_token_ids) == 10


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 40, SamplingParams(), "max_model_len"),
        ([1, 10**6], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(temperature=float("nan")), "finite"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(top_k=-2), "top_k"),
    ],
)
def test_bad_requests_are_refused_and_leave_no_trace(smollm2, prompt, params, message) -> None:
    model, tokenizer = smollm2
    engine = make_engine(model, tokenizer, max_model_len=40)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(EngineRequest("bad", prompt, params))
    assert not engine.has_unfinished()
    assert generate_one(engine, [1, 2, 3], greedy(2), "good").finish_reason is FinishReason.LENGTH

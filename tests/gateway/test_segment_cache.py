"""gateway/prompt/segment_cache.py: a prompt encoded piece by piece, earlier messages' pieces from the cache, gives
exactly the ids of encoding it whole, on the tokenizers we ship (SmolLM2's, and the same with DeepSeek's special
tokens added), over rendered conversations and random text thick with special tokens and pieces of them; a growing
conversation encodes only its new messages; the cache stays within its capacity; a tokenizer it cannot vouch for
is encoded whole."""

from __future__ import annotations

import json
import threading
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gateway.prompt.chat import ChatMessage, ChatRequest
from gateway.prompt.prompt_format import PromptFormat
from gateway.prompt.segment_cache import SegmentCache, split_tokens
from gateway.prompt.served_model import ServedModel
from protos import rank_worker_pb2 as pb
from rank_worker.model_files.opener import open_model_source

DEEPSEEK_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
]


@cache
def smollm2_json() -> str:
    bundle = open_model_source("").tokenizer
    assert bundle is not None
    return bundle.tokenizer_json


@cache
def deepseek_json() -> str:
    tokenizer = Tokenizer.from_str(smollm2_json())
    tokenizer.add_special_tokens(DEEPSEEK_TOKENS)
    return tokenizer.to_str()


@cache
def _tokenizer(tokenizer_json: str) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json)


def whole(tokenizer_json: str, text: str) -> list[int]:
    return _tokenizer(tokenizer_json).encode_batch([text], add_special_tokens=False)[0].ids


def cache_for(tokenizer_json: str, capacity: int = 1_000_000) -> SegmentCache:
    return SegmentCache.for_tokenizer_json(Tokenizer.from_str(tokenizer_json), tokenizer_json, capacity)


def test_the_chat_markers_are_split_tokens() -> None:
    assert {"<|im_start|>", "<|im_end|>"} <= set(split_tokens(smollm2_json()))
    assert set(DEEPSEEK_TOKENS) <= set(split_tokens(deepseek_json()))


def _with_added(tokenizer_json: str, **token: object) -> str:
    spec = json.loads(tokenizer_json)
    spec["added_tokens"].append({"id": 99_999, "special": True, "lstrip": False, "rstrip": False} | token)
    return json.dumps(spec)


def test_tokens_that_could_move_a_cut_are_not_split_tokens() -> None:
    base = smollm2_json()
    # takes whitespace from its left, or needs a word boundary: the cut would change what is to its left
    assert "<L>" not in split_tokens(_with_added(base, content="<L>", lstrip=True, normalized=False))
    assert "<W>" not in split_tokens(_with_added(base, content="<W>", single_word=True, normalized=False))
    assert "<N>" not in split_tokens(_with_added(base, content="<N>", normalized=True))
    # another added token could match from an earlier start and run over where the text was cut
    covered = _with_added(base, content="x<|im_start|>", normalized=False)
    assert "<|im_start|>" not in split_tokens(covered)
    assert "<|im_end|>" in split_tokens(covered)
    assert split_tokens("not json") == []
    # a tokenizer that truncates or pads would do it to each piece on its own
    for setting in ("truncation", "padding"):
        spec = json.loads(base)
        spec[setting] = {"max_length": 512}
        assert split_tokens(json.dumps(spec)) == []


def _conversation(turns: int) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content="You are a coding agent. " * 40)]
    for turn in range(turns):
        messages.append(ChatMessage(role="user", content=f"tool result {turn}:\n" + "def f(x):\n    return x\n" * 30))
        messages.append(ChatMessage(role="assistant", content=f"Step {turn}: I read the file and call the next tool."))
    return messages


def test_a_growing_conversation_encodes_only_its_new_messages() -> None:
    info = pb.ModelInfoResponse(
        served_model_name="m", model_id="m", max_model_len=1 << 20, tokenizer_json=smollm2_json(), bos_token_id=-1
    )
    info.chat_template = open_model_source("").tokenizer.chat_template
    model = ServedModel.from_info(info)
    plain = ServedModel.from_info(info, tokenize_cache_tokens=0)
    assert model.segments is not None and plain.segments is None
    prompts = PromptFormat.for_model(model)
    for turns in range(1, 8):
        chat = ChatRequest(model="m", messages=_conversation(turns))
        text = prompts.render(chat)
        misses = model.segments.misses
        assert model.encode(text) == plain.encode(text)
        if turns > 1:  # the last turn's user and assistant messages, the generation prompt and an end marker at most
            assert model.segments.misses - misses <= 4
    assert model.segments.hits > 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=st.characters(codec="utf-8"), max_size=30),
            st.sampled_from([" ", "\n", "  \n", "123", "'s", "<|", "|>", "<|im_", "start|>", "｜", "<think", "▁"]),
            st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", *DEEPSEEK_TOKENS]),
        ),
        max_size=40,
    )
)
def test_any_text_encodes_to_the_ids_of_the_whole(parts: list[str]) -> None:
    text = "".join(parts)
    for tokenizer_json in (smollm2_json(), deepseek_json()):
        segments = _shared_cache(tokenizer_json)
        assert segments.encode(text) == whole(tokenizer_json, text)
        assert segments.encode(text) == whole(tokenizer_json, text)  # again, from the cache


@cache
def _shared_cache(tokenizer_json: str) -> SegmentCache:
    return cache_for(tokenizer_json)  # one for all examples: pieces of earlier ones are hit too


def test_the_cache_keeps_within_its_capacity_least_recently_used_out_first() -> None:
    one = "<|im_start|>user\n" + "alpha beta gamma " * 20
    two = "<|im_start|>user\n" + "delta epsilon zeta " * 20
    size = max(len(whole(smollm2_json(), one)), len(whole(smollm2_json(), two)))
    segments = cache_for(smollm2_json(), capacity=size + 10)  # room for one of them, not both
    segments.encode(one)
    segments.encode(two)
    assert 0 < segments.cached_tokens <= size + 10
    hits = segments.hits
    segments.encode(two)
    assert segments.hits == hits + 1  # the recent one stayed
    segments.encode(one)
    assert segments.hits == hits + 1  # the older one went
    huge = "<|im_start|>" + "word " * 500  # one piece past the whole capacity: encoded, never kept
    assert segments.encode(huge) == whole(smollm2_json(), huge)
    assert segments.cached_tokens <= size + 10


def test_a_tokenizer_without_split_tokens_is_encoded_whole() -> None:
    spec = json.loads(smollm2_json())
    spec["added_tokens"] = [token | {"special": False} for token in spec["added_tokens"]]
    tokenizer_json = json.dumps(spec)
    segments = cache_for(tokenizer_json)
    text = "<|im_start|>user\nhello<|im_end|>\n"
    assert segments.encode(text) == whole(tokenizer_json, text)
    assert segments.cached_tokens == 0 and segments.misses == 0


def test_threads_encoding_at_once_each_get_their_own_ids() -> None:
    segments = cache_for(smollm2_json())
    texts = ["".join(f"<|im_start|>user\nmessage {m} of thread {t}<|im_end|>\n" for m in range(30)) for t in range(8)]
    expected = [whole(smollm2_json(), text) for text in texts]
    got: dict[int, list[int]] = {}

    def run(index: int) -> None:
        for _ in range(5):
            got[index] = segments.encode(texts[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [got[i] for i in range(len(texts))] == expected


def test_real_claude_code_requests_encode_only_their_new_messages() -> None:
    """The request bodies the real CLIs sent (tests/gateway/data/claude_code/, rendered as the gateway renders them):
    each encodes to the ids of its whole prompt, and after the first most of each one's tokens come from the cache."""
    from test_claude_code_prompt import RECORDED, recorded_prompts

    from gateway.prompt.render import ModelTemplate

    bundle = open_model_source("").tokenizer
    template = ModelTemplate.for_model(
        "HuggingFaceTB/SmolLM2-135M-Instruct", bundle.chat_template, bundle.bos_token, bundle.eos_token
    )
    assert RECORDED
    for path in RECORDED:
        segments = cache_for(smollm2_json())
        seen: list[tuple[int, int]] = []
        segments.observe = lambda cached, encoded, seen=seen: seen.append((cached, encoded))
        for prompt in recorded_prompts(path, template):
            assert segments.encode(prompt) == whole(smollm2_json(), prompt), path.name
        assert seen[0][0] == 0  # the first request: nothing cached yet
        later_cached = sum(cached for cached, _ in seen[1:])
        later_encoded = sum(encoded for _, encoded in seen[1:])
        # the recorded sessions: 99.6-99.7% (their new messages are a few hundred tokens over 12-23K)
        assert later_cached >= 0.95 * (later_cached + later_encoded), (path.name, seen)

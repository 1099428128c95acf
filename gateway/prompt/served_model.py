"""The model this gateway serves, as its ranks describe it: accepted names, tokenizer, limits, template."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from contracts.config import TOKENIZE_CACHE_TOKENS
from gateway.http.errors import ModelNotAvailable
from gateway.prompt.prompt_size import PromptSizeBound
from gateway.prompt.segment_cache import SegmentCache
from protos import rank_worker_pb2 as pb


@dataclass
class ServedModel:
    info: pb.ModelInfoResponse
    tokenizer: Tokenizer
    names: list[str] = field(default_factory=list)  # accepted in the `model` field, the served name first
    created_at: int = 0
    size_bound: PromptSizeBound = field(default_factory=lambda: PromptSizeBound(0))  # 0: count exactly
    segments: SegmentCache | None = None  # the ids of earlier messages' text (segment_cache.py); None: encode whole

    @classmethod
    def from_info(
        cls,
        info: pb.ModelInfoResponse,
        deployment_slug: str = "",
        created_at: int = 0,
        tokenize_cache_tokens: int = TOKENIZE_CACHE_TOKENS,
    ) -> ServedModel:
        if not info.tokenizer_json:
            raise ValueError(f"model {info.model_id} has no tokenizer: the gateway cannot serve it")
        names = [info.served_model_name]
        for alias in (deployment_slug, "default"):
            if alias and alias not in names:
                names.append(alias)
        tokenizer = Tokenizer.from_str(info.tokenizer_json)
        bound = PromptSizeBound.for_tokenizer_json(info.tokenizer_json)
        segments = None
        if tokenize_cache_tokens > 0:
            segments = SegmentCache.for_tokenizer_json(tokenizer, info.tokenizer_json, tokenize_cache_tokens)
        return cls(info, tokenizer, names, created_at, bound, segments)

    @property
    def name(self) -> str:
        return self.info.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def check_name(self, requested: str) -> None:
        """Any name we do not serve (claude-* ids included) is refused, naming what is served."""
        if requested not in self.names:
            raise ModelNotAvailable(
                f"Model {requested or '(none)'} is not available on this endpoint; available models: "
                + ", ".join(self.names)
            )

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids; raises PromptTooLong, without tokenizing, for a text that its size alone
        shows cannot fit max_model_len."""
        self.size_bound.refuse_what_cannot_fit(text, self.max_model_len)
        if self.segments is not None:
            ids = self.segments.encode(text)
        else:
            # encode_batch lets go of the GIL while it works (encode holds it): the event loop keeps serving.
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if self.info.add_bos_token and self.info.bos_token_id >= 0 and (not ids or ids[0] != self.info.bos_token_id):
            ids = [self.info.bos_token_id, *ids]
        return ids

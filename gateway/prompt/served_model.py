"""The model this gateway serves, as its ranks describe it: accepted names, tokenizer, limits, template."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from gateway.http.errors import ModelNotAvailable
from gateway.prompt.prompt_size import PromptSizeBound
from protos import rank_worker_pb2 as pb


@dataclass
class ServedModel:
    info: pb.ModelInfoResponse
    tokenizer: Tokenizer
    names: list[str] = field(default_factory=list)  # accepted in the `model` field, the served name first
    created_at: int = 0
    size_bound: PromptSizeBound = field(default_factory=lambda: PromptSizeBound(0))  # 0: count exactly

    @classmethod
    def from_info(cls, info: pb.ModelInfoResponse, deployment_slug: str = "", created_at: int = 0) -> ServedModel:
        if not info.tokenizer_json:
            raise ValueError(f"model {info.model_id} has no tokenizer: the gateway cannot serve it")
        names = [info.served_model_name]
        for alias in (deployment_slug, "default"):
            if alias and alias not in names:
                names.append(alias)
        tokenizer = Tokenizer.from_str(info.tokenizer_json)
        return cls(info, tokenizer, names, created_at, PromptSizeBound.for_tokenizer_json(info.tokenizer_json))

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
        # encode_batch lets go of the GIL while it works (encode holds it): the event loop keeps serving.
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if self.info.add_bos_token and self.info.bos_token_id >= 0 and (not ids or ids[0] != self.info.bos_token_id):
            ids = [self.info.bos_token_id, *ids]
        return ids

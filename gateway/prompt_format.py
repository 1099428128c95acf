"""How one model's prompts are written and its output read: the chat template and tool format for its
family, the output parser (reasoning, tool calls), and stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.chat import ChatRequest
from gateway.parsing.pipeline import OutputParser, make_output_parser
from gateway.parsing.stop_strings import StopMatcher
from gateway.prompt.family import prompt_opens_reasoning
from gateway.prompt.render import ModelTemplate, render_prompt
from gateway.served_model import ServedModel


@dataclass
class PromptFormat:
    template: ModelTemplate

    @classmethod
    def for_model(cls, model: ServedModel) -> PromptFormat:
        info = model.info
        vocab = set(model.tokenizer.get_vocab(with_added_tokens=True))
        return cls(
            ModelTemplate.for_model(
                info.model_id, info.chat_template, info.bos_token, info.eos_token, vocab, info.model_type
            )
        )

    def render(self, chat: ChatRequest) -> str:
        return render_prompt(chat, self.template)

    def output_parser(self, prompt_text: str) -> OutputParser:
        # Thinking templates may open <think> in the prompt itself: then the output starts inside it.
        return make_output_parser(self.template.family, self.template.thinks, prompt_opens_reasoning(prompt_text))

    def stop_matcher(self, stop: list[str]) -> StopMatcher:
        return StopMatcher(stop)

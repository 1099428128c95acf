"""How one model's prompts are written and its output read: the chat template and tool format for its
family, the output parser (reasoning, tool calls), and stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.chat import ChatRequest
from gateway.parsing.pipeline import OutputParser, make_output_parser
from gateway.parsing.stop_strings import StopStringMatcher
from gateway.prompt.render import ModelTemplate, family_for, render_prompt, thinks
from gateway.served_model import ServedModel


@dataclass
class PromptFormat:
    template: ModelTemplate
    thinks: bool

    @classmethod
    def for_model(cls, model: ServedModel) -> PromptFormat:
        info = model.info
        vocab = set(model.tokenizer.get_vocab(with_added_tokens=True))
        family = family_for(info.model_id, info.chat_template, vocab)
        template = ModelTemplate(
            chat_template=info.chat_template, bos_token=info.bos_token, eos_token=info.eos_token, family=family
        )
        return cls(template, thinks(info.model_id, info.chat_template, vocab))

    def render(self, chat: ChatRequest) -> str:
        return render_prompt(chat, self.template)

    def output_parser(self, chat: ChatRequest) -> OutputParser:
        # Thinking templates open <think> in the prompt when reasoning is on, so output starts inside it.
        reasoning = self.thinks and chat.reasoning is not False
        return make_output_parser(self.template.family, reasoning, starts_in_reasoning=False)

    def stop_matcher(self, stop: list[str]) -> StopStringMatcher:
        return StopStringMatcher(stop)

"""How one model's prompts are written and its output read: the chat template and tool format for its
family, the output parser (reasoning, tool calls), and stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.parsing.pipeline import OutputParser, make_output_parser
from gateway.parsing.stop_strings import StopMatcher
from gateway.prompt.chat import ChatRequest
from gateway.prompt.deepseek_prompt import EOS as DEEPSEEK_EOS
from gateway.prompt.family import prompt_opens_reasoning
from gateway.prompt.prompt_size import refuse_what_does_not_fit
from gateway.prompt.render import ModelTemplate, render_prompt
from gateway.prompt.served_model import ServedModel


@dataclass
class PromptFormat:
    template: ModelTemplate
    # Texts that end a reply although no token stands for them: DeepSeek's end-of-sentence marker when the
    # tokenizer has no such token (a DeepSeek shape served with another family's tokenizer, as the benchmark
    # shapes are). The rank cannot stop on it (it is several tokens), so the gateway stops there, and the
    # reply ends its turn (end_turn), not at a stop sequence the client asked for.
    end_of_turn: tuple[str, ...] = ()

    @classmethod
    def for_model(cls, model: ServedModel) -> PromptFormat:
        info = model.info
        vocab = set(model.tokenizer.get_vocab(with_added_tokens=True))
        template = ModelTemplate.for_model(
            info.model_id, info.chat_template, info.bos_token, info.eos_token, vocab, info.model_type
        )
        return cls(template, end_of_turn_texts(template, vocab))

    def render(self, chat: ChatRequest) -> str:
        return render_prompt(chat, self.template)

    def output_parser(self, prompt_text: str) -> OutputParser:
        # Thinking templates may open <think> in the prompt itself: then the output starts inside it.
        return make_output_parser(self.template.family, self.template.thinks, prompt_opens_reasoning(prompt_text))

    def stop_matcher(self, stop: list[str]) -> StopMatcher:
        return StopMatcher([*stop, *self.end_of_turn])

    def ends_turn(self, matched: str, stop: list[str]) -> bool:
        """The matched text ended the reply's turn (the model's own end marker), not a client's stop sequence."""
        return matched in self.end_of_turn and matched not in stop


def end_of_turn_texts(template: ModelTemplate, vocab: set[str]) -> tuple[str, ...]:
    if template.family != "deepseek_dsml":
        return ()
    eos = template.eos_token or DEEPSEEK_EOS
    return () if eos in vocab else (eos,)


def prompt_of(model: ServedModel, prompts: PromptFormat, chat: ChatRequest) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids, once the model name and the prompt's size are checked: what the
    gateway sends a rank, and what the fleet's EPP hashes (gateway/epp/picker.py) to find the node holding it."""
    model.check_name(chat.model)
    text = prompts.render(chat)
    ids = model.encode(text)
    refuse_what_does_not_fit(len(ids), model.max_model_len)
    return text, ids

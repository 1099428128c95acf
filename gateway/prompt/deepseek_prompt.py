"""A ChatRequest in DeepSeek's chat format, written here rather than by the model's Jinja template.

    <｜begin▁of▁sentence｜>{tools section}{system}<｜User｜>{user}<｜Assistant｜>{reply}<｜end▁of▁sentence｜>
    \\n\\n<function_results>\\n<result>{result}</result>\\n</function_results>\\n\\n{reply}<｜end▁of▁sentence｜>

where a reply is [<think>{reasoning}</think> | </think>]{content}[\\n\\n<｜DSML｜function_calls>...]. That is
the layout of DeepSeek-V3.2's own encoder (encoding_dsv32.py) but for the tools section, which comes before
the system text here (conversation.SystemPrompt says why): the only DeepSeek model trained on tool markup we
can parse as it streams is V3.2 (DSML), so V2 and V3 get its tool calls and results too, with the turn
markers V2.5, V3, V3.1, R1 and V3.2 all use. DeepSeek-V2(-Lite)-Chat's own template writes its turns as
plain "User: " / "Assistant:" text instead: when the model's template does, so do we (markers_for).

Why not the model's template: DeepSeek's are not prefix-stable (R1's and V3.1's drop the reasoning of
earlier turns and open <think> in the generation prompt only; the V3.2 encoder drops it at each new user
message), V3.2 ships none, and a benchmark shape carries another model's template. The markers are written
as text: with DeepSeek's tokenizer they encode to its special tokens, with another tokenizer to plain
text; the same on every turn either way.

Prefix stability: a message renders from itself and the messages before it alone, and the history's
opening of a reply is the generation prompt that began it, followed by what the model wrote. So reasoning
is kept on every later turn (as the Hermes path keeps it), and a turn without reasoning shows `</think>`,
which is what the model was given when thinking was off. A prompt never ends in whitespace: a BPE tokenizer
splits trailing whitespace differently once text follows it, and the next turn's tokens would diverge there.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.prompt.chat import ChatMessage, ChatRequest
from gateway.prompt.conversation import join_sections, system_prompt, tool_choice_line, tools_in_force
from gateway.prompt.dsml_prompt import dsml_calls, dsml_results, dsml_tools_section

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class TurnMarkers:
    user: str  # opens a user turn
    assistant: str  # opens a reply
    after_system: str = ""
    after_user: str = ""


# V2-Chat-0628, V2.5, V3, V3.1, R1, V3.2: special tokens, nothing between the turns.
SPECIAL_MARKERS = TurnMarkers("<｜User｜>", "<｜Assistant｜>")
# V2-Chat and V2-Lite-Chat: "User: {u}\n\nAssistant: {a}<eos>"; the model's reply starts with the space,
# so "Assistant:" is followed by the reply exactly as the model wrote it.
PLAIN_V2_MARKERS = TurnMarkers("User: ", "Assistant:", after_system="\n\n", after_user="\n\n")


def markers_for(chat_template: str) -> TurnMarkers:
    """The model's own markers where its template is DeepSeek's V2 one, else the special-token ones (also for
    templates that are not DeepSeek's at all)."""
    if SPECIAL_MARKERS.user not in chat_template and "'User: '" in chat_template:
        return PLAIN_V2_MARKERS
    return SPECIAL_MARKERS


def deepseek_prompt(
    chat: ChatRequest, markers: TurnMarkers = SPECIAL_MARKERS, *, thinks: bool = False, eos_token: str = ""
) -> str:
    """The prompt text for `chat`, ending with the opening of the model's reply.

    thinks: the model writes <think> reasoning (then every reply opens with <think> or </think>, and earlier
    reasoning is shown); thinking is on for this reply when the request asks for it (chat.reasoning).
    eos_token: what ends a reply, the tokenizer's end-of-sequence token (DeepSeek's <｜end▁of▁sentence｜>
    when empty): that token ended the model's turn, and as a special token it never merges with the reply's
    last characters (DeepSeek's marker as plain text would: "...calls>" + "<｜end" tokenizes as "><")."""
    end = eos_token or EOS
    system, rest = system_prompt(chat.messages)
    tools = tools_in_force(chat)
    choice = tool_choice_line(chat.tool_choice, tools)
    system_text = join_sections(dsml_tools_section(tools), system.shared, system.session, choice)
    parts = [BOS, system_text + markers.after_system if system_text else ""]
    results: list[ChatMessage] = []
    after_results = False
    for message in rest:
        if message.role == "tool":
            results.append(message)
            continue
        if results:
            parts.append("\n\n" + dsml_results(results))
            results, after_results = [], True
        if message.role == "assistant":
            parts.append(_reply_opening(markers, after_results, thinks) + _reply(message, thinks) + end)
        else:  # user, or a system message after the first turn: DeepSeek has no marker for those
            parts.append(markers.user + message.content + markers.after_user)
        after_results = False
    if results:
        parts.append("\n\n" + dsml_results(results))
        after_results = True
    opening = _reply_opening(markers, after_results, thinks)
    if thinks:
        opening += THINK_OPEN if chat.reasoning else THINK_CLOSE  # DeepSeek's default is thinking off
    parts.append(opening)
    return "".join(parts)


def _reply_opening(markers: TurnMarkers, after_results: bool, thinks: bool) -> str:
    """What precedes a reply: the assistant marker after a user turn. After tool results V3.2 goes straight
    on ("\\n\\n" then <think> or </think>); a model that does not think gets the assistant marker there too,
    so that its prompt does not end in whitespace."""
    if not after_results:
        return markers.assistant
    return "\n\n" if thinks else "\n\n" + markers.assistant


def _reply(message: ChatMessage, thinks: bool) -> str:
    text = message.content
    calls = dsml_calls(message.tool_calls)
    if calls:
        text += "\n\n" + calls  # V3.2 writes the blank line before its calls even with no text
    if not thinks:
        return text  # a model that does not think is not shown reasoning (as on the Hermes path)
    if message.reasoning:
        return THINK_OPEN + message.reasoning + THINK_CLOSE + text
    return THINK_CLOSE + text

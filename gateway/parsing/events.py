"""What the output parsers emit, in order, as model text streams in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... within one response
    id: str  # "toolu_..." style id, unique per call
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    fragment: str  # a piece of the arguments JSON object; the pieces concatenate to valid JSON


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


OutputEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd

"""A parsed body validated into its pydantic schema, the long lists (messages, tools, content blocks) a few
hundred items at a time.

pydantic validates a whole document in one call that holds the GIL: 300,000 messages held it for five
seconds, during which the event loop served nobody. In slices, the interpreter can hand the GIL back
between them. Items already validated are model instances, which pydantic then takes as they are."""

from __future__ import annotations

import types
import typing
from functools import cache
from itertools import compress
from operator import attrgetter
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from gateway.http.errors import InvalidBody

Body = TypeVar("Body", bound=BaseModel)

SLICE_ITEMS = 256  # items validated per call: a few milliseconds each
FREE_SLICE_ITEMS = 1024  # items freed at once by empty_in_slices: about a millisecond
MAX_PROBLEMS = 5


def validate_body(schema: type[Body], document: dict[str, Any]) -> Body:
    problems: list[str] = []
    prepared = _slice_lists(schema, document, (), problems)
    if problems:
        raise InvalidBody("; ".join(problems[:MAX_PROBLEMS]))
    try:
        return schema.model_validate(prepared)
    except ValidationError as exc:
        raise InvalidBody("; ".join(_describe(exc, ())[:MAX_PROBLEMS])) from exc


def _slice_lists(
    model: type[BaseModel], data: dict[str, Any], where: tuple[Any, ...], problems: list[str]
) -> dict[str, Any]:
    """`data` with each long list of model items, at any depth, replaced by the validated items (their
    problems collected); short lists are left to the final validation."""
    replaced: dict[str, Any] = {}
    for name, item_model in _list_fields(model).items():
        value = data.get(name)
        if not isinstance(value, list):
            continue
        inner = [
            _slice_lists(item_model, item, (*where, name, index), problems) if isinstance(item, dict) else item
            for index, item in enumerate(value)
        ]
        if len(problems) >= MAX_PROBLEMS:
            return data
        if len(value) <= SLICE_ITEMS:
            if any(new is not old for new, old in zip(inner, value, strict=True)):
                replaced[name] = inner
            continue
        adapter = _list_adapter(item_model)
        items: list[Any] = []
        for start in range(0, len(inner), SLICE_ITEMS):
            try:
                items.extend(adapter.validate_python(inner[start : start + SLICE_ITEMS]))
            except ValidationError as exc:
                problems.extend(_describe(exc, (*where, name), offset=start))
                if len(problems) >= MAX_PROBLEMS:
                    return data
        replaced[name] = items
    return {**data, **replaced} if replaced else data


def empty_in_slices(body: BaseModel) -> None:
    """Empty the lists of models in `body` (at any depth), innermost first and a slice at a time: a body of a
    million content blocks freed in one go holds the GIL for most of a second; in slices the interpreter can
    hand it to the event loop's thread between them. For a body no one else uses any more."""
    found: list[list[Any]] = []
    holders: list[BaseModel] = [body]
    while holders:
        below: list[BaseModel] = []
        for holder in holders:
            for name in _list_fields(type(holder)):
                items = holder.__dict__.get(name)
                if type(items) is not list or not items or not isinstance(items[0], BaseModel):
                    continue
                found.append(items)
                for inner_name in _list_fields(type(items[0])):
                    # The few items with a list of their own, picked out without a Python step per item (in
                    # slices too: one C call over a million items would hold the GIL as long as freeing them)
                    for start in range(0, len(items), FREE_SLICE_ITEMS * 16):
                        part = items[start : start + FREE_SLICE_ITEMS * 16]
                        with_values = compress(part, map(attrgetter(inner_name), part))
                        below += [item for item in with_values if type(getattr(item, inner_name)) is list]
        holders = below
    for items in reversed(found):  # a list was found after the one holding it
        while items:
            del items[-FREE_SLICE_ITEMS:]


@cache
def _list_fields(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Fields that may hold a list of models (list[M], list[M] | None, str | list[M]), by name."""
    fields: dict[str, type[BaseModel]] = {}
    for name, info in model.model_fields.items():
        for option in _union_options(info.annotation):
            if typing.get_origin(option) is list:
                (item,) = typing.get_args(option) or (Any,)
                if isinstance(item, type) and issubclass(item, BaseModel):
                    fields[name] = item
    return fields


def _union_options(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


@cache
def _list_adapter(item_model: type[BaseModel]) -> TypeAdapter[list[Any]]:
    return TypeAdapter(list[item_model])  # type: ignore[valid-type]


def _describe(exc: ValidationError, where: tuple[Any, ...], offset: int = 0) -> list[str]:
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        loc = list(error["loc"])
        if offset and loc and isinstance(loc[0], int):
            loc[0] += offset
        path = ".".join(str(part) for part in (*where, *loc)) or "body"
        problems.append(f"{path}: {error['msg']}")
    return problems

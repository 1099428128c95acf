"""TokenizerBundle from the tokenizer files of a Hugging Face model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from rank_worker.engine.interface import TokenizerBundle
from rank_worker.model_files.hf_config import read_json
from rank_worker.model_files.source import ModelPathError


def load_hf_tokenizer(directory: Path, hf_config: dict[str, Any]) -> TokenizerBundle:
    """Read tokenizer.json (required) plus the optional tokenizer_config.json, chat_template.jinja and
    generation_config.json beside it."""
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ModelPathError(f"model directory {directory} has no tokenizer.json")
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise ModelPathError(f"{tokenizer_path} is not a valid tokenizer: {exc}") from exc

    tok_config = _optional_json(directory / "tokenizer_config.json")
    gen_config = _optional_json(directory / "generation_config.json")

    bos_token = _token_text(tok_config.get("bos_token"))
    bos_id = _token_id(tokenizer, bos_token, tokenizer_path)
    if bos_id is None:
        bos_id = _first_id(hf_config.get("bos_token_id"))
        bos_token = (tokenizer.id_to_token(bos_id) or "") if bos_id is not None else ""

    eos_token = _token_text(tok_config.get("eos_token"))
    # tokenizer_config's eos first (it is the one chat templates write), then every id generation stops on.
    eos_ids = _unique(
        [
            _token_id(tokenizer, eos_token, tokenizer_path),
            *_id_list(gen_config.get("eos_token_id")),
            *_id_list(hf_config.get("eos_token_id")),
        ]
    )
    if not eos_token and eos_ids:
        eos_token = tokenizer.id_to_token(eos_ids[0]) or ""

    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        # Llama 3 style: no flag, the BOS is added by tokenizer.json's post-processor instead.
        add_bos = bos_id is not None and _post_processor_adds(json.loads(tokenizer_json).get("post_processor"), bos_id)

    return TokenizerBundle(
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(directory, tok_config),
        bos_token_id=bos_id,
        eos_token_ids=tuple(eos_ids),
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos_token=bool(add_bos),
    )


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _chat_template(directory: Path, tok_config: dict[str, Any]) -> str:
    # Newer transformers save the template as its own file, and it wins over tokenizer_config.json when both exist.
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template") or ""
    if isinstance(template, list):
        # Several named templates ([{"name": ..., "template": ...}]); "default" is the one for plain chat.
        named = {entry.get("name"): entry.get("template", "") for entry in template if isinstance(entry, dict)}
        template = named.get("default") or next(iter(named.values()), "")
    return template if isinstance(template, str) else ""


def _token_text(value: Any) -> str:
    """Special tokens are stored either as plain strings or as AddedToken dicts with a "content" key."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _token_id(tokenizer: Tokenizer, token: str, tokenizer_path: Path) -> int | None:
    if not token:
        return None
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ModelPathError(f"special token {token!r} from tokenizer_config.json is not in {tokenizer_path}")
    return token_id


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _first_id(value: Any) -> int | None:
    ids = _id_list(value)
    return ids[0] if ids else None


def _unique(ids: list[int | None]) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))


def _post_processor_adds(processor: Any, token_id: int) -> bool:
    """Whether a tokenizer.json post-processor puts `token_id` in front of a single sequence."""
    if not isinstance(processor, dict):
        return False
    if processor.get("type") == "Sequence":
        return any(_post_processor_adds(p, token_id) for p in processor.get("processors", []))
    if processor.get("type") != "TemplateProcessing":
        return False
    single = processor.get("single") or []
    first = single[0].get("SpecialToken") if single and isinstance(single[0], dict) else None
    if not first:
        return False
    special = (processor.get("special_tokens") or {}).get(first.get("id"), {})
    return token_id in special.get("ids", [])

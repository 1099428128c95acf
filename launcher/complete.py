"""`kvserve complete`: one chat completion against a rank worker, printed as the tokens arrive.

A rank takes calls that carry the internal secret only: complete sends the one given (--secret-file), else the
config's internal_secret_file, else the one `kvserve up` made in its default state dir.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tokenizers import Tokenizer

from contracts import internal_auth
from contracts.config import KvServeConfig
from gateway.prompt.chat_template import render_chat
from gateway.prompt.detokenizer import IncrementalDetokenizer
from protos import rank_worker_pb2 as pb
from protos import rank_worker_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # ModelInfo carries the tokenizer json
UP_SECRET_FILE = Path(".kvserve/run/internal-secret")  # `kvserve up`'s default state dir


@dataclass(frozen=True)
class CompletionArgs:
    prompt: str
    system: str | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    raw: bool = False


def prompt_token_ids(info: pb.ModelInfoResponse, tokenizer: Tokenizer, args: CompletionArgs) -> list[int]:
    """Token ids for the prompt as this model expects them: through its chat template, or as is with --raw."""
    if args.raw:
        ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
        if info.add_bos_token and info.bos_token_id >= 0:
            ids = [info.bos_token_id, *ids]
        return ids
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    text = render_chat(info.chat_template, messages, bos_token=info.bos_token, eos_token=info.eos_token)
    return tokenizer.encode(text, add_special_tokens=False).ids  # the template already placed the specials


def stats_line(finished: pb.Finished) -> str:
    stats = finished.stats
    decode_s = stats.total_s - stats.queue_wait_s - stats.prefill_s
    rate = (stats.output_tokens - 1) / decode_s if stats.output_tokens > 1 and decode_s > 0 else 0.0
    reason = pb.FinishReason.Name(finished.finish_reason).removeprefix("FINISH_REASON_").lower()
    cached = stats.l0_cached_tokens + stats.l1_cached_tokens  # cached_tokens: L0 + L1, as the gateway reports it
    return (
        f"[prompt {stats.prompt_tokens} tokens ({cached} cached), output {stats.output_tokens} tokens, "
        f"queue {stats.queue_wait_s * 1000:.0f} ms, prefill {stats.prefill_s * 1000:.0f} ms, "
        f"decode {rate:.1f} tok/s, finish: {reason}]"
    )


def secret_for_complete(config: KvServeConfig, secret_file: str | None) -> internal_auth.InternalSecret | None:
    """The secret to send: --secret-file, the config's internal_secret_file, or `kvserve up`'s; None with
    internal_auth off, or when there is none (the rank then answers UNAUTHENTICATED)."""
    if secret_file:
        return internal_auth.read_secret_file(secret_file)
    if not config.internal_auth:
        return None
    if config.internal_secret_file:
        return internal_auth.read_secret_file(config.internal_secret_file)
    return internal_auth.read_secret_file(UP_SECRET_FILE) if UP_SECRET_FILE.is_file() else None


def complete(
    target: str,
    args: CompletionArgs,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    secret: internal_auth.InternalSecret | None = None,
) -> int:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with internal_auth.channel(target, options=options, secret=secret) as channel:
        stub = pb_grpc.RankWorkerStub(channel)
        info: pb.ModelInfoResponse = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        if not info.tokenizer_json:
            err.write(f"error: {info.model_id} has no tokenizer (random weights?); complete needs one\n")
            return 1
        tokenizer = Tokenizer.from_str(info.tokenizer_json)
        request = pb.GenerateRequest(
            prompt_token_ids=prompt_token_ids(info, tokenizer, args),
            sampling=pb.SamplingParams(
                temperature=args.temperature,
                max_tokens=args.max_tokens,
                stop_token_ids=list(info.eos_token_ids),
            ),
        )
        detokenizer = IncrementalDetokenizer(tokenizer)
        finished: pb.Finished | None = None
        for response in stub.Generate(request):
            if response.HasField("tokens"):
                out.write(detokenizer.push(response.tokens.token_ids))
                out.flush()
            elif response.HasField("finished"):  # not Progress (sent while no token is due)
                finished = response.finished
        out.write(detokenizer.finish() + "\n")
        out.flush()
    if finished is not None:
        err.write(stats_line(finished) + "\n")
    return 0

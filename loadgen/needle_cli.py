"""`kvserve needle`: the needle quality gate against a running gateway (Anthropic /v1/messages).

For each length: fit a needle document to the length with the gateway's own count_tokens, ask about the
needle cold at temperature 0, ask the same request again (now cached), and compare. Exit 0 when every
tested length answered identically and the warm request read enough from cache; 1 on a failure; 2 when
the gate could not start (bad flags, gateway unreachable)."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from loadgen.needle import (
    DEFAULT_MIN_WARM_HIT,
    Answer,
    LengthResult,
    NeedleDocument,
    auto_lengths,
    fit_document,
    parse_lengths,
    plan_lengths,
    prompt_budget,
    report_json,
)

if TYPE_CHECKING:
    import httpx

# With no known context, auto mode doubles up to this and stops at the first length the gateway refuses.
PROBE_CEILING = 1 << 20
# Fields a /v1/models entry may carry for the context window (ours does not yet: --max-context then).
_CONTEXT_FIELDS = ("max_model_len", "max_context_length", "context_length", "context_window", "max_input_tokens")
_CONTEXT_IN_REFUSAL = re.compile(r"context is (\d+) tokens")


class PromptRefused(Exception):
    """The gateway refused the prompt as too long for the model (400 before any GPU work)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        found = _CONTEXT_IN_REFUSAL.search(message)
        self.max_context = int(found.group(1)) if found else None


class GatewayError(Exception):
    """Any other failed request, with the gateway's status and message."""


class NeedleGateway:
    """The three calls the gate makes, over one HTTP client."""

    def __init__(self, client: httpx.Client, model: str) -> None:
        self.client = client
        self.model = model

    def count_tokens(self, document: NeedleDocument) -> int:
        body = {"model": self.model, "messages": self._messages(document)}
        return int(self._post("/v1/messages/count_tokens", body)["input_tokens"])

    def ask(self, document: NeedleDocument, max_tokens: int) -> Answer:
        """The question at temperature 0, non-streaming."""
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "messages": self._messages(document)}
        started = time.monotonic()
        response = self._post("/v1/messages", body)
        seconds = time.monotonic() - started
        usage = response.get("usage") or {}
        blocks = response.get("content", [])
        text = "".join(block.get("text", "") for block in blocks if block.get("type") == "text")
        thinking = "".join(block.get("thinking", "") for block in blocks if block.get("type") == "thinking")
        return Answer(
            text=text,
            input_tokens=int(usage.get("input_tokens", 0)),
            cache_read_tokens=int(usage.get("cache_read_input_tokens") or 0),
            output_tokens=int(usage.get("output_tokens", 0)),
            stop_reason=response.get("stop_reason"),
            seconds=seconds,
            thinking=thinking,
        )

    def _messages(self, document: NeedleDocument) -> list[dict[str, str]]:
        return [{"role": "user", "content": document.prompt}]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(path, json=body)
        if response.status_code == 200:
            return response.json()
        message = _error_message(response)
        if response.status_code == 400 and "too long" in message:
            raise PromptRefused(message)
        raise GatewayError(f"{path} answered {response.status_code}: {message}")


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def served_model(client: httpx.Client) -> tuple[str, int | None]:
    """The first model the gateway lists, and its context window if the listing says."""
    response = client.get("/v1/models")
    if response.status_code != 200:
        raise GatewayError(f"/v1/models answered {response.status_code}: {_error_message(response)}")
    entry = response.json()["data"][0]
    context = next((int(entry[f]) for f in _CONTEXT_FIELDS if isinstance(entry.get(f), int)), None)
    return str(entry["id"]), context


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve needle",
        description="Quality gate: one fact hidden in a long document, asked cold and again from cache at "
        "temperature 0; the answers must be identical.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway (default: %(default)s)")
    parser.add_argument("--api-key", help="API key (default: $ANTHROPIC_API_KEY; none needed for a local gateway)")
    parser.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    parser.add_argument(
        "--lengths",
        default="auto",
        help="context lengths in tokens, e.g. 4096,8k,32k; auto = doubling from 4096 to the model's context "
        "(default: auto)",
    )
    parser.add_argument(
        "--max-context",
        type=int,
        help="the model's context window in tokens (default: from /v1/models, else found from the gateway's "
        "refusal of a prompt that does not fit)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length (default: %(default)s)")
    parser.add_argument("--depth", type=float, default=0.5, help="where the fact sits, 0..1 (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the filler and the needle (default: 0)")
    parser.add_argument(
        "--min-warm-hit",
        type=float,
        default=DEFAULT_MIN_WARM_HIT,
        help="the warm request must read at least this share of its prompt from cache (default: %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the report here")
    return parser


def main(argv: Sequence[str], transport: httpx.BaseTransport | None = None) -> int:
    """Run the gate; 0 = passed, 1 = failed, 2 = could not run. `transport` replaces the network (tests)."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    console = Console()
    try:
        requested = parse_lengths(args.lengths)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0.0 <= args.depth <= 1.0:
        parser.error("--depth must be within [0, 1]")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    try:
        import httpx
    except ImportError:
        console.print("[red]kvserve needle needs httpx: pip install httpx[/red]")
        return 2

    api_key = args.api_key or os.environ.get("ANTHROPIC_API_KEY") or "local"
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    client = httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout, transport=transport)
    with client:
        try:
            listed_model, listed_context = served_model(client)
        except (httpx.HTTPError, GatewayError, KeyError, IndexError, ValueError) as exc:
            console.print(f"[red]cannot reach the gateway at {args.url}: {exc}[/red]")
            return 2
        model = args.model or listed_model
        max_context = args.max_context or listed_context
        run = _GateRun(NeedleGateway(client, model), args, console)
        run.run(requested, max_context)

    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "url": args.url,
        "model": model,
        "max_context": run.max_context,
        "max_tokens": args.max_tokens,
        "depth": args.depth,
        "seed": args.seed,
    }
    report = report_json(run.results, run.skipped, args.min_warm_hit, meta, run.errors)
    _print_report(console, run.results, report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report written to {args.json}")
    return 0 if report["passed"] else 1


class _GateRun:
    """The lengths in order, with what was learned about the context along the way."""

    def __init__(self, gateway: NeedleGateway, args: argparse.Namespace, console: Console) -> None:
        self.gateway = gateway
        self.args = args
        self.console = console
        self.max_context: int | None = None
        self.results: list[LengthResult] = []
        self.skipped: list[int] = []
        self.errors: list[str] = []

    def run(self, requested: list[int] | None, max_context: int | None) -> None:
        """Every length in order; a refusal as too long skips it and all longer ones."""
        import httpx

        self.max_context = max_context
        auto = requested is None
        lengths = auto_lengths(max_context or PROBE_CEILING) if auto else list(requested or [])
        pending, self.skipped = plan_lengths(lengths, max_context)
        while pending:
            length = pending.pop(0)
            try:
                self.results.append(self.one_length(length))
            except PromptRefused as exc:
                self.console.print(f"[yellow]{length}: the gateway refused the prompt: {exc}[/yellow]")
                self.skipped.append(length)
                self.max_context = self.max_context or exc.max_context
                # Longer ones cannot fit either. Auto mode's longer ones were only guesses, so they are
                # dropped, not reported; it still tests the context itself once the refusal tells it.
                if not auto:
                    self.skipped += pending
                pending = []
                if auto and exc.max_context and all(exc.max_context > r.length for r in self.results):
                    pending = [exc.max_context]
            except (GatewayError, ValueError, KeyError) as exc:
                self.errors.append(f"{length}: {exc}")
                self.console.print(f"[red]{length}: {exc}[/red]")
            except httpx.HTTPError as exc:  # transport errors and timeouts: report, go on with the next length
                self.errors.append(f"{length}: {type(exc).__name__}: {exc}")
                self.console.print(f"[red]{length}: {type(exc).__name__}: {exc}[/red]")
        self.skipped.sort()

    def one_length(self, length: int) -> LengthResult:
        args = self.args
        budget = prompt_budget(length, args.max_tokens)
        if budget < 64:
            raise ValueError(f"length {length} leaves no room for a document with --max-tokens {args.max_tokens}")
        # The nonce is new every run: nothing of this document can be cached before the cold ask.
        nonce = uuid.uuid4().hex[:16]
        seed = args.seed * 1_000_003 + length
        fitted = fit_document(budget, self.gateway.count_tokens, seed, nonce, args.depth)
        self.console.print(f"{length}: document of {fitted.prompt_tokens} tokens; asking cold ...")
        cold = self.gateway.ask(fitted.document, args.max_tokens)
        self.console.print(f"{length}: cold {cold.seconds:.1f} s; asking warm ...")
        warm = self.gateway.ask(fitted.document, args.max_tokens)
        return LengthResult(length, fitted.document, fitted.prompt_tokens, cold, warm)


def _print_report(console: Console, results: Sequence[LengthResult], report: dict[str, Any]) -> None:
    table = Table(title=f"needle gate: {report['model']} at {report['url']}")
    for column in ("length", "prompt", "cache hit\ncold/warm", "seconds\ncold/warm", "found\ncold/warm"):
        table.add_column(column, justify="right")
    table.add_column("answers", justify="center")
    table.add_column("verdict", justify="center")
    for result, entry in zip(results, report["lengths"], strict=True):
        found = "/".join("yes" if entry[side]["found_needle"] else "no" for side in ("cold", "warm"))
        table.add_row(
            str(result.length),
            str(result.prompt_tokens),
            f"{result.cold.cache_hit:.0%}/{result.warm.cache_hit:.0%}",
            f"{result.cold.seconds:.1f}/{result.warm.seconds:.1f}",
            found,
            "[green]same[/green]" if result.match else "[red]DIFFER[/red]",
            "[green]pass[/green]" if entry["passed"] else "[red]FAIL[/red]",
        )
    console.print(table)
    for result in results:
        document = result.document
        console.print(
            f"{result.length}: needle {document.needle.fact!r} at depth {document.actual_depth:.2f};"
            f" cold answer {result.cold.text!r}",
            markup=False,
        )
    if report["skipped"]:
        console.print(f"skipped (do not fit the context): {', '.join(map(str, report['skipped']))}")
    if report["passed"]:
        console.print("[bold green]PASS[/bold green]: cached answers are identical to cold ones")
    else:
        console.print("[bold red]FAIL[/bold red]")
        for reason in report["failures"]:
            console.print(f"  {reason}", markup=False)

"""The `kvserve` command: `rank-worker`, `complete`, `up`, `compose`, `keys`, `secret`, `sessions`, `bench`,
`needle`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from gateway.http.errors import ChatTemplateError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="KV-cache-aware LLM serving for coding agents.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser(
        "rank-worker",
        add_help=False,  # its own flags (and --help) are parsed by rank_worker.main
        help="run one engine rank as a gRPC server (see: kvserve rank-worker --help)",
    )

    commands.add_parser(
        "epp",
        add_help=False,  # its own flags (and --help) are parsed by gateway.epp.main
        help="run the fleet's endpoint picker for Envoy (see: kvserve epp --help)",
    )

    complete = commands.add_parser("complete", help="stream one chat completion from a rank worker")
    complete.add_argument("prompt", help="the user message")
    complete.add_argument("--system", help="a system message")
    complete.add_argument("--max-tokens", type=int, default=128)
    complete.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    complete.add_argument("--target", help="rank worker host:port (default: from the config)")
    complete.add_argument("--config", help="YAML config file (for the default target)")
    complete.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    complete.add_argument(
        "--secret-file",
        help="the internal secret (default: the config's internal_secret_file, else .kvserve/run/internal-secret)",
    )

    sessions = commands.add_parser(
        "sessions",
        help="the router's per-session view: calls, tokens from L0 / L1 / computed, cache hit, cold prefills, rank",
    )
    sessions.add_argument("--limit", type=int, default=50, help="the newest N sessions (default: 50; 0 = all)")
    sessions.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sessions.add_argument("--target", help="router host:port (default: the config's router, else router_host:port)")
    sessions.add_argument("--config", help="YAML config file (for the default target and the secret)")
    sessions.add_argument(
        "--secret-file",
        help="the internal secret (default: the config's internal_secret_file, else .kvserve/run/internal-secret)",
    )

    up = commands.add_parser(
        "up", help="start the local stack (redis, kvstore, router, rank workers, gateway) until Ctrl-C"
    )
    up.add_argument("--ranks", type=int, default=1, help="rank workers to start (consecutive ports, a GPU each)")
    _add_expert_parallel(up)
    up.add_argument("--config", help="YAML config file, passed to every service")
    up.add_argument(
        "--gpus",
        default="",
        help="the GPU of each rank, e.g. 0,0 (ranks naming one GPU share it and split gpu_memory_utilization); "
        "default: one visible GPU each",
    )
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a rank worker may take to load")
    up.add_argument("--state-dir", default=".kvserve/run", help="logs, redis data, services.json")

    compose = commands.add_parser("compose", help="render docker-compose.yml from the stack's topology")
    compose.add_argument("--ranks", type=int, help="rank workers, one GPU each (default: 4; --cpu: 1)")
    _add_expert_parallel(compose)
    compose.add_argument(
        "--cpu",
        action="store_true",
        help="a CPU node's compose file: no GPU reservation, the CPU image (Dockerfile build arguments), a memory "
        "limit per service, config/compose-cpu.yaml",
    )
    compose.add_argument(
        "--config", help="the config file mounted in containers (default: config/compose.yaml; --cpu: compose-cpu.yaml)"
    )
    compose.add_argument("--output", "-o", default="docker-compose.yml", help="file to write, or - for stdout")

    # Their own flags (and --help) are parsed by the tools themselves.
    commands.add_parser(
        "bench",
        add_help=False,
        help="load tools: `kvserve bench agents ...` (agent load generator), `kvserve bench simulate ...` (capacity)",
    )
    commands.add_parser(
        "needle", add_help=False, help="the needle quality gate: a fact in a long document, cold vs cached"
    )

    keys = commands.add_parser("keys", help="manage the gateway's API keys").add_subparsers(
        dest="keys_command", required=True, metavar="ACTION"
    )
    for action, help_text in (
        ("create", "create a key and print its secret once"),
        ("list", "list keys"),
        ("revoke", "remove a key (a running gateway refuses it from its next request)"),
    ):
        sub = keys.add_parser(action, help=help_text)
        sub.add_argument("--file", help="key file (default: the config's api_keys_file, else ./kvserve-keys.json)")
        sub.add_argument("--config", help="YAML config file (for the default key file)")
        if action == "create":
            sub.add_argument("--name", required=True, help="who or what the key is for")
            sub.add_argument(
                "--models",
                help="allowed models: m1,m2 or * for all; a name covers every name of its model ('default' and the "
                "served name are one). Default: *, or none with --metrics",
            )
            sub.add_argument(
                "--metrics",
                action="store_true",
                help="the metrics scope: the key may read GET /metrics (no key may otherwise, '*' included); "
                "alone it makes a scraper's key that cannot run models",
            )
        if action == "revoke":
            sub.add_argument("key", help="the key's id (as `kvserve keys list` shows it), or its name if unique")

    preflight = commands.add_parser(
        "preflight",
        help="before `docker compose up`: GPUs the file reserves that this host lacks, missing or open secret files, "
        "published ports in use",
    )
    preflight.add_argument("--file", "-f", default="docker-compose.yml", help="the compose file (default: %(default)s)")

    secret = commands.add_parser("secret", help="make the internal plane's secret files (for compose)")
    secret_create = secret.add_subparsers(dest="secret_command", required=True, metavar="ACTION").add_parser(
        "create", help="write a new random secret (mode 0600) unless the file exists"
    )
    secret_create.add_argument("--file", required=True, help="e.g. kvserve-internal-secret, kvserve-redis-password")
    return parser


def _add_expert_parallel(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--expert-parallel",
        type=int,
        metavar="R",
        help="ranks per expert-parallel group (a MoE model's experts split across them): ranks 0..R-1 form the "
        "first group, R..2R-1 the next, ...; R must divide --ranks. Default: the config's expert_parallel_size",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "rank-worker":
        from rank_worker.main import main as rank_worker_main

        return rank_worker_main(rest)
    if args.command == "epp":
        from gateway.epp.main import main as epp_main

        return epp_main(rest)
    if args.command == "bench":
        return _bench(rest)
    if args.command == "needle":
        from loadgen.needle_cli import main as needle_main

        return needle_main(rest)
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "complete":
        return _complete(args)
    if args.command == "sessions":
        if args.limit < 0:
            build_parser().error("--limit must be 0 (all) or more")
        return _sessions(args)
    if args.command == "compose":
        args.ranks = args.ranks if args.ranks is not None else (1 if args.cpu else 4)
        args.config = args.config or ("config/compose-cpu.yaml" if args.cpu else "config/compose.yaml")
    if args.command in ("up", "compose") and args.ranks < 1:
        build_parser().error("--ranks must be at least 1")
    if args.command in ("up", "compose") and args.expert_parallel is not None:
        if args.expert_parallel < 1:
            build_parser().error("--expert-parallel must be at least 1")
        if args.ranks % args.expert_parallel:
            build_parser().error(
                f"--expert-parallel {args.expert_parallel} must divide --ranks {args.ranks}: each expert-parallel "
                "group is that many whole ranks"
            )
    if args.command == "up":
        from launcher.up import UpOptions, run_up

        gpus = tuple(gpu.strip() for gpu in args.gpus.split(",") if gpu.strip())
        options = UpOptions(
            args.config, args.ranks, args.ready_timeout, Path(args.state_dir), gpus, args.expert_parallel
        )
        return run_up(options)
    if args.command == "compose":
        return _compose(args)
    if args.command == "keys":
        from launcher.keys import create_command, keys_file, list_command, revoke_command

        path = keys_file(args.file, args.config)
        if args.keys_command == "create":
            return create_command(path, args.name, args.models, args.metrics)
        return revoke_command(path, args.key) if args.keys_command == "revoke" else list_command(path)
    if args.command == "preflight":
        return _preflight(Path(args.file))
    if args.command == "secret":
        from launcher.stack_secrets import create_command as create_secret_command

        return create_secret_command(Path(args.file))
    raise AssertionError(args.command)


def _preflight(compose_file: Path) -> int:
    from launcher.preflight import check, host_gpus

    if not compose_file.is_file():
        print(f"error: {compose_file} does not exist: render it with `kvserve compose` (or --cpu)", file=sys.stderr)
        return 1
    problems = check(compose_file, host_gpus())
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print(f"{compose_file}: {len(problems)} problem(s) to fix before `docker compose up`", file=sys.stderr)
        return 1
    print(f"{compose_file}: ready for `docker compose up`", file=sys.stderr)
    return 0


def _bench(rest: list[str]) -> int:
    tools = {"agents": "loadgen.agents_cli", "simulate": "simulator.cli"}
    if not rest or rest[0] not in tools:
        print(f"usage: kvserve bench {{{','.join(tools)}}} [options]  (--help after the tool name for its options)")
        return 0 if rest and rest[0] in ("-h", "--help") else 2
    import importlib

    return importlib.import_module(tools[rest[0]]).main(rest[1:])


def _compose(args: argparse.Namespace) -> int:
    from launcher.compose import render_compose

    output = Path("docker-compose.yml" if args.output == "-" else args.output)
    try:
        text = render_compose(args.ranks, Path(args.config), output, args.expert_parallel, args.cpu)
    except (FileNotFoundError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.output == "-":
        sys.stdout.write(text)
    else:
        output.write_text(text)
        groups = f" in expert-parallel groups of {args.expert_parallel}" if (args.expert_parallel or 1) > 1 else ""
        node = "on a CPU node" if args.cpu else "a GPU each"
        workers = f"{args.ranks} rank worker{'s' if args.ranks != 1 else ''}"
        print(f"wrote {output} ({workers}, {node}{groups}, config {args.config})", file=sys.stderr)
    return 0


def _complete(args: argparse.Namespace) -> int:
    from contracts.config import load_config
    from contracts.internal_auth import InternalAuthError
    from contracts.service_main import client_target
    from launcher.complete import CompletionArgs, complete, secret_for_complete

    config = load_config(args.config)
    target = args.target or client_target(config.rank_worker_host, config.rank_worker_port)
    completion = CompletionArgs(args.prompt, args.system, args.max_tokens, args.temperature, args.raw)
    try:
        return complete(target, completion, secret=secret_for_complete(config, args.secret_file))
    except InternalAuthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"\nerror from {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except ChatTemplateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _sessions(args: argparse.Namespace) -> int:
    from contracts.config import load_config
    from contracts.internal_auth import InternalAuthError
    from contracts.service_main import client_target
    from launcher.complete import secret_for_complete
    from launcher.sessions import list_sessions, print_sessions

    config = load_config(args.config)
    target = args.target or config.router or client_target(config.router_host, config.router_port)
    try:
        reply = list_sessions(target, args.limit, secret_for_complete(config, args.secret_file))
    except InternalAuthError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"error from the router at {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    print_sessions(reply, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

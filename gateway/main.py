"""Start the gateway: `python -m gateway` or `kvserve gateway`."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from contracts import internal_auth
from contracts.config import load_config
from gateway.http.auth import AuthConfigError
from gateway.http.header_deadline import header_deadline_protocol


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve gateway", description="HTTP gateway (Anthropic + OpenAI APIs)")
    parser.add_argument("--config", help="YAML config file (default: $KVSERVE_CONFIG)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--rank", action="append", dest="ranks", help="rank worker host:port (repeatable)")
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {}
    if args.host:
        overrides["gateway_host"] = args.host
    if args.port is not None:
        overrides["gateway_port"] = args.port
    if args.ranks:
        overrides["rank_workers"] = args.ranks
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config, **overrides)

    from gateway.http.app import create_app

    try:
        internal_auth.configure(config)  # what its calls to the router and the ranks carry
        app = create_app(config)
    except (AuthConfigError, internal_auth.InternalAuthError) as exc:
        logging.getLogger("gateway").error("%s", exc)
        return 2
    # keep-alive well past clients' idle-pool expiry (httpx: 5 s), so a client never reuses a connection the
    # server is closing at that very moment (a reset with no response)
    uvicorn.run(
        app,
        host=config.gateway_host,
        port=config.gateway_port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=75,
        # h11 with a deadline for request headers (uvicorn has none); the body's is the app's own
        http=header_deadline_protocol(config.request_read_timeout_secs),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one gateway process holds: config, rank client, the served model once a rank has described it,
the generation pipeline, API keys and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from contracts.config import KvServeConfig
from gateway.http.auth import auth_mode, open_local_warning
from gateway.http.live_keys import LiveKeyStore
from gateway.observability.metrics import GatewayMetrics
from gateway.prompt.prompt_format import PromptFormat
from gateway.prompt.served_model import ServedModel
from gateway.ranks.generation import Generation
from gateway.ranks.rank_choice import RankChooser, RouterRanks, StaticRanks
from gateway.ranks.rank_client import RankClient
from gateway.ranks.session_key import routing_session_id
from protos import router_pb2 as router_pb

if TYPE_CHECKING:
    from gateway.observability.request_log import RequestRecord

log = logging.getLogger(__name__)


def rank_targets(config: KvServeConfig) -> list[str]:
    """The static rank list (no router)."""
    return config.rank_workers or [f"{config.rank_worker_host}:{config.rank_worker_port}"]


class GatewayState:
    def __init__(self, config: KvServeConfig, apis: Iterable[str] = ()) -> None:
        """`apis`: the names the APIs registered, each a label of the metrics."""
        self.config = config
        self.metrics = GatewayMetrics(apis)
        self.metrics.waiting_for_rank.set_function(
            lambda: self.generation.waiting_for_rank if self.generation is not None else 0
        )
        mode = auth_mode(config)  # refuses an open gateway on a reachable address
        self.keys: LiveKeyStore | None = LiveKeyStore(config.api_keys_file) if mode == "keys" else None
        if self.keys is None:
            log.warning(open_local_warning(config))
        # made in connect(): grpc.aio channels belong to the serving loop
        self.ranks: RankClient | None = None
        self.chooser: RankChooser | None = None
        self.model: ServedModel | None = None
        self.generation: Generation | None = None
        self.started_at = int(time.time())

    async def connect(self, retry_every_s: float = 1.0) -> None:
        """Ask the ranks what they serve, until one answers (they may still be loading)."""
        if self.ranks is None:
            self.ranks = RankClient()
            self.chooser = self._make_chooser()
        assert self.chooser is not None
        while self.model is None:
            if isinstance(self.chooser, RouterRanks):
                await self.chooser.refresh()
            try:
                info = await self.ranks.model_info(self.chooser.known_addresses())
            except ConnectionError as exc:
                log.info("waiting for a rank worker: %s", exc)
                await asyncio.sleep(retry_every_s)
                continue
            model = ServedModel.from_info(
                info, self.config.deployment_slug, self.started_at, self.config.tokenize_cache_tokens
            )
            if model.segments is not None:
                model.segments.observe = self.metrics.observe_tokenized
            self.generation = Generation(
                self.ranks,
                self.chooser,
                model,
                PromptFormat.for_model(model),
                ping_interval_s=self.config.ping_interval_secs,
                request_timeout_s=self.config.request_timeout_secs,
                rank_stall_s=self.config.rank_stall_secs,
                rank_recovery_wait_s=self.config.rank_recovery_wait_secs,
                default_temperature=self.config.default_temperature,
                default_top_p=self.config.default_top_p,
            )
            self.model = model
            log.info("serving %s (max_model_len %d) as %s", info.model_id, info.max_model_len, ", ".join(model.names))

    def report_finished(self, record: RequestRecord) -> None:
        """A request of a session that reached a rank ended: tell the router, for its per-session view (in the
        background; nothing without a router, a session or a rank)."""
        if not isinstance(self.chooser, RouterRanks) or not record.session or not record.rank:
            return
        prompt = max(record.prompt_tokens, 0)
        l1 = min(max(record.l1_cached_tokens, 0), prompt)
        l0 = min(max(record.cached_tokens - record.l1_cached_tokens, 0), prompt - l1)
        report = router_pb.ReportFinishedRequest(
            session_id=routing_session_id(record.session),  # the id the router routed it by
            rank_id=record.rank,
            prompt_tokens=prompt,
            l0_cached_tokens=l0,
            l1_cached_tokens=l1,
            output_tokens=max(record.output_tokens, 0),
        )
        self.chooser.report_finished(report, self.metrics.observe_session_report)

    def _make_chooser(self) -> RankChooser:
        if not self.config.router:
            return StaticRanks(rank_targets(self.config))
        chooser = RouterRanks(self.config.router, self.config.rank_workers)
        chooser.start()
        return chooser

    async def close(self) -> None:
        if self.chooser is not None:
            await self.chooser.close()
        if self.ranks is not None:
            await self.ranks.close()

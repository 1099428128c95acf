"""A small real stack (one rank worker with the embedded model, a short context, and a gateway) shared by
the bad-input tests of this folder, with the gateway's pid for its memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from service_processes import free_port, start_gateway, start_rank_worker
from small_stack import SMALL_CONTEXT, SmallStack


@pytest.fixture(scope="session")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallStack]:
    tmp = tmp_path_factory.mktemp("small-stack")
    rank_port, gateway_port = free_port(), free_port()
    rank = {"KVSERVE_NUM_KV_BLOCKS": "64", "KVSERVE_MAX_MODEL_LEN": str(SMALL_CONTEXT), "KVSERVE_MAX_NUM_SEQS": "4"}
    with (
        start_rank_worker(tmp / "rank.log", rank_port, **rank),
        start_gateway(tmp / "gateway.log", gateway_port, [rank_port]) as gateway,
    ):
        yield SmallStack(f"http://127.0.0.1:{gateway_port}", gateway_port, gateway.pid, rank_port)

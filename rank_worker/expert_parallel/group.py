"""An expert-parallel group of ranks over torch.distributed: formed at a rendezvous, watched for dead or hung
peers, and the collectives its MoE layers and its lockstep use.

Two process groups: `control`, gloo over the host (each step's agreement, small integer tensors, on the CPU
whatever the device), and `device`, NCCL between GPUs (the MoE exchange) or the control group itself on the
CPU. The group's rank 0 hosts the TCPStore the ranks meet at (expert_parallel_rendezvous).

A peer that dies or hangs must not leave the others waiting inside a collective forever. Each rank's watchdog
thread bumps its own heartbeat counter in the store every `interval` and checks its peers': a counter that has
not moved for `timeout` (SIGSTOP), or a store that no longer answers (rank 0 gone, or stopped: a second thread
watches the watchdog's own store calls come back), breaks the group. So does a collective that raises (a peer's
socket closed: SIGKILL). A broken group ends the process with EXIT_GROUP_BROKEN: its ranks are restarted together
(the launcher; see contracts/expert_parallel.py) and the gateways continue the cut streams once it is back.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from contracts.address import split_host_port
from contracts.config import KvServeConfig
from contracts.expert_parallel import EXIT_GROUP_BROKEN
from rank_worker.expert_parallel.shard import ExpertShard

log = logging.getLogger(__name__)

HEARTBEAT_FRACTION = 0.2  # heartbeats every timeout * this (2 s at the default 10 s)
# An idle rank's wake thread blocks on the store this long per call (no spinning; its own connection, so nothing
# waits behind it). Long: torch logs two warnings for every wait that times out.
WAKE_WAIT_S = 30.0


@dataclass(frozen=True)
class GroupSettings:
    rank: int
    size: int
    rendezvous: str  # host:port; rank 0 listens there
    name: str = "ep"
    timeout_s: float = 10.0  # a silent peer is dead or hung after this
    form_timeout_s: float = 600.0  # the ranks may take this long to meet (a peer still starting)
    collective_timeout_s: float = 1800.0  # gloo's own limit on one collective (the watchdog acts long before)

    @property
    def shard(self) -> ExpertShard:
        return ExpertShard(self.rank, self.size)


class ExpertGroup:
    """One rank's view of its group; `form` returns it once every rank has joined."""

    def __init__(
        self,
        settings: GroupSettings,
        store: dist.Store,
        device: torch.device,
        on_broken: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.rank = settings.rank
        self.size = settings.size
        self.name = settings.name
        self.device = device
        # A TCPStore client serves one call at a time: the watchdog, the idle ranks' wake-ups and everything else
        # each get a connection of their own, so a long wait on one never holds up a heartbeat.
        self._store = store
        self._watch_store = store.clone()
        self._wake_store = store.clone()
        self._announce_store = store.clone()  # the engine thread's
        self._on_broken = on_broken or _exit_broken
        self._broken = threading.Event()
        self._stop = threading.Event()
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=settings.collective_timeout_s)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.size, timeout=timeout)
        self.device_group = dist.group.WORLD
        # gloo beside NCCL for the host-side agreement; on the CPU the one gloo group serves both
        self.control_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        self._beat = 0
        self._answered_at = time.monotonic()  # when the watchdog's last round of store calls came back
        self._watchdog = threading.Thread(target=self._watch, name="ep-watchdog", daemon=True)
        self._store_deadline = threading.Thread(target=self._watch_answers, name="ep-store-deadline", daemon=True)

    @classmethod
    def form(
        cls,
        settings: GroupSettings,
        device: torch.device,
        on_broken: Callable[[str], None] | None = None,
    ) -> ExpertGroup:
        """Meet the other ranks at the rendezvous (rank 0 hosts the store) and start the watchdog. Blocks until
        every rank has joined or form_timeout_s passes (a TimeoutError names the group)."""
        try:
            host, port = split_host_port(settings.rendezvous)
        except ValueError:
            raise ValueError(f"expert_parallel_rendezvous must be host:port, got {settings.rendezvous!r}") from None
        started = time.monotonic()
        try:
            store = dist.TCPStore(
                host,
                port,
                settings.size,
                is_master=settings.rank == 0,
                timeout=datetime.timedelta(seconds=settings.form_timeout_s),
                wait_for_workers=True,
            )
        except (RuntimeError, TimeoutError) as exc:
            raise TimeoutError(
                f"expert-parallel group {settings.name}: rank {settings.rank} of {settings.size} could not meet "
                f"the others at {settings.rendezvous} within {settings.form_timeout_s:g} s: {exc}"
            ) from exc
        # From here on a store call that does not answer within the failure timeout is a broken group.
        store.set_timeout(datetime.timedelta(seconds=settings.timeout_s))
        store.set(f"heartbeat/{settings.rank}", "0")  # before the barrier: the peers' watchdogs read it at once
        group = cls(settings, store, device, on_broken)
        group.barrier()
        group._answered_at = time.monotonic()
        group._watchdog.start()
        group._store_deadline.start()
        log.info(
            "expert-parallel group %s formed: rank %d of %d at %s in %.1f s (%s)",
            settings.name,
            settings.rank,
            settings.size,
            settings.rendezvous,
            time.monotonic() - started,
            "nccl + gloo" if device.type == "cuda" else "gloo",
        )
        return group

    # --- collectives (a raise is a broken group: a peer's connection closed) ---

    def barrier(self) -> None:
        self._checked(lambda: dist.barrier(group=self.control_group), "barrier")

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the group of an int64 CPU tensor (the control group)."""
        self._checked(lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.control_group), "agreement")
        return values

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size * rows, ...]: every rank's x in rank order (the device group)."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self._checked(lambda: dist.all_gather_into_tensor(out, x.contiguous(), group=self.device_group), "gather")
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [size * rows, ...] from every rank, summed: this rank's block of rows (the device group)."""
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        self._checked(lambda: _reduce_scatter(out, x.contiguous(), group=self.device_group), "combine")
        return out

    def _checked(self, call: Callable[[], object], what: str) -> None:
        try:
            call()
        except Exception as exc:  # a peer gone mid-collective: gloo's connection closed, NCCL's error
            self.broken(f"{what} failed: {exc}")
            raise

    # --- the store: wake-ups of idle ranks ---

    def announce(self, key: str) -> None:
        """Set `key` in the group's store (a wake-up the idle ranks wait for)."""
        try:
            self._announce_store.set(key, "1")
        except Exception as exc:
            self.broken(f"the store did not answer: {exc}")
            raise

    def wait_for(self, key: str, seconds: float, waker: bool = False) -> bool:
        """Block up to `seconds` for `key` to be set (no spinning: the store answers when it is); False if not.
        waker: the lockstep's wake thread's own connection."""
        try:
            (self._wake_store if waker else self._store).wait([key], datetime.timedelta(seconds=seconds))
            return True
        except Exception as exc:
            if "timeout" in str(exc).lower() or isinstance(exc, TimeoutError):
                return False
            if not self._stop.is_set():
                self.broken(f"the store did not answer: {exc}")
            return False

    # --- failure ---

    @property
    def is_broken(self) -> bool:
        return self._broken.is_set()

    def broken(self, reason: str) -> None:
        """The group cannot go on (a peer dead or hung): once, on whichever thread noticed first."""
        if self._stop.is_set() or self._broken.is_set():
            return
        self._broken.set()
        log.error("expert-parallel group %s broken at rank %d: %s", self.name, self.rank, reason)
        self._on_broken(reason)

    @property
    def _interval(self) -> float:
        return max(self.settings.timeout_s * HEARTBEAT_FRACTION, 0.05)

    def _watch(self) -> None:
        """Bump this rank's heartbeat, and break the group when a peer's has not moved for timeout_s."""
        timeout = self.settings.timeout_s
        interval = self._interval
        keys = [f"heartbeat/{rank}" for rank in range(self.size) if rank != self.rank]
        last_value: dict[str, bytes] = {}
        last_change = {key: time.monotonic() for key in keys}
        while not self._stop.wait(interval):
            try:
                self._beat += 1
                self._watch_store.set(f"heartbeat/{self.rank}", str(self._beat))
                values = self._watch_store.multi_get(keys) if keys else []
            except Exception as exc:
                if not self._stop.is_set():
                    self.broken(f"the group's store at {self.settings.rendezvous} did not answer: {exc}")
                return
            now = self._answered_at = time.monotonic()
            for key, value in zip(keys, values, strict=True):
                if value != last_value.get(key):
                    last_value[key] = value
                    last_change[key] = now
                elif now - last_change[key] > timeout:
                    peer = key.rsplit("/", 1)[1]
                    self.broken(f"rank {peer} has not answered for {now - last_change[key]:.1f} s (dead or hung)")
                    return

    def _watch_answers(self) -> None:
        """Break the group when the watchdog's store calls stop coming back. The store's host (rank 0) stopped
        (SIGSTOP) answers nothing, and TCPStore, its wait timed out, cancels it and then waits for the cancel's answer
        without a limit: the watchdog would block for good, its peers' heartbeats unread."""
        timeout = self.settings.timeout_s
        while not self._stop.wait(self._interval):
            silent = time.monotonic() - self._answered_at
            if silent > timeout:
                self.broken(
                    f"the group's store at {self.settings.rendezvous} has not answered for {silent:.1f} s "
                    "(rank 0 dead or hung)"
                )
                return

    def stop_watching(self) -> None:
        """A clean stop has begun (the whole group stops): a peer going away from now on is no failure."""
        self._stop.set()

    def close(self) -> None:
        """Leave the group (a clean stop of the whole group: its peers stop too)."""
        self._stop.set()
        for thread in (self._watchdog, self._store_deadline):
            if thread.is_alive():
                thread.join(timeout=2 * self.settings.timeout_s)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the peers may be gone already
                log.debug("destroy_process_group failed", exc_info=True)


# torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor warns); the GPU machine's 2.11 has the older name
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _exit_broken(reason: str) -> None:
    """The default on a broken group: end the process now (threads may be blocked inside a collective) with the
    code the launcher restarts the whole group on."""
    logging.shutdown()
    os._exit(EXIT_GROUP_BROKEN)


def settings_from_config(config: KvServeConfig) -> GroupSettings | None:
    """The group a rank worker's config puts it in, or None for a rank on its own (expert_parallel_size 1)."""
    if config.expert_parallel_size == 1:
        return None
    if config.expert_parallel_rank >= config.expert_parallel_size:
        raise ValueError(
            f"expert_parallel_rank {config.expert_parallel_rank} is outside a group of {config.expert_parallel_size}"
        )
    if not config.expert_parallel_rendezvous:
        raise ValueError("expert_parallel_size > 1 needs expert_parallel_rendezvous (host:port of the group's rank 0)")
    return GroupSettings(
        rank=config.expert_parallel_rank,
        size=config.expert_parallel_size,
        rendezvous=config.expert_parallel_rendezvous,
        name=config.expert_parallel_group or f"ep@{config.expert_parallel_rendezvous}",
        timeout_s=config.expert_parallel_timeout_secs,
        collective_timeout_s=max(1800.0, 2 * config.rank_max_step_secs),
    )

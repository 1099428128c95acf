"""The one typed configuration every service reads: a YAML file, then KVSERVE_* environment variables.

Precedence (highest first): explicit keyword arguments, environment (KVSERVE_MAX_NUM_SEQS=...), the file
named by KVSERVE_CONFIG (or passed as config_file), defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

# The decode step budget where decode_step_budget_ms is unset and the rank runs on CUDA (see the key).
GPU_DECODE_STEP_BUDGET_MS = 40.0
# Token ids the gateway keeps of prompts' messages (tokenize_cache_tokens): ~64 MB, ~30 sessions of 500K tokens.
TOKENIZE_CACHE_TOKENS = 16_000_000


class SchedulingConfig(BaseModel):
    """Which requests each engine step of a rank runs: one section of the config, handed as it is to the rank's
    scheduler (and the simulator's); the router reads its warm_prefix_fraction and l1_restore_cost, the units
    of the load ranks report. Config files and KVSERVE_* variables write its keys flat (max_cold_prefills: 2,
    KVSERVE_MAX_COLD_PREFILLS=2), or under scheduling:."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduling_policy: Literal["fifo", "warm_first"] = Field(
        "warm_first", description="admission order: arrival order, or warm (mostly cached) requests first"
    )
    warm_prefix_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="warm_first: a request is warm when its cached prefix covers this much"
    )
    max_cold_prefills: int = Field(0, ge=0, description="warm_first: cold requests in prefill at once; 0 = no cap")
    cold_max_wait_secs: float = Field(
        30.0,
        ge=0.0,
        description="warm_first: a cold request or prefill that has gone this long without a token is starved: "
        "admitted with the warm ones, and a minimum chunk of its own every step from then on. Either policy: the "
        "longest a request whose context is in L1 waits for room to restore it whole (then what fits is restored)",
    )
    # 40 ms on a GPU: decoders keep >= 20 tok/s (the load generator's per-agent p50 bar) while prefill runs
    # beside them, with room to spare; on the H200 a 4K-token chunk held every decoder for 150-470 ms. 50 ms until
    # 2026-12-06: with decode_payback the decoders average at most one token per budget, so 50 ms put them at the
    # bar itself (8 DeepSeek agents ran 17.1 and 20.3 tok/s, bench/results/2026-12-06-h100-peer-dsv2-agents); at
    # 40 ms with payback the same load ran 22.5 (bench/results/2026-12-06-h100-peer-dsv2-new-defaults).
    # Off on the CPU by default: there a decode step alone takes longer than 50 ms (SmolLM2-135M: ~160 ms), so the
    # budget would only cut every prefill beside a decoder to min_prefill_chunk_tokens and multiply time to first
    # token.
    decode_step_budget_ms: float | None = Field(
        None,
        ge=0.0,
        description="while sequences decode, a step's prefill is cut so its predicted time stays within this; "
        f"0 = off (prefill takes max_num_batched_tokens); unset: {GPU_DECODE_STEP_BUDGET_MS:g} on CUDA, off on the CPU",
    )
    # Progress for prefill even when the decodes alone fill the budget. 1024, not less: a small chunk over a
    # long cached prefix pays for the whole prefix each time and fills few multiprocessors (H200, llama-8b,
    # beside 64 decoders: 256 new tokens over 16K cached cost 21 ms, 1024 cost 49 ms: 82 against 48 us a
    # token). Under the agent load (48 agents) TTFT p95 went from 9.7 to 6.2 s at the same decode speed.
    min_prefill_chunk_tokens: int = Field(
        1024, ge=1, description="prefill tokens every step gets, whatever decode_step_budget_ms says"
    )
    # Over a long context, or beside many decoders past the pool, that floor alone can take more than a budget
    # (DeepSeek-V2-Lite, H200: 80-270 ms steps beside 4 agents' decoders at 250-400K tokens), and without payback
    # the decoders then get a token per such step. On by default since 2026-12-06 (it acts only where a budget is
    # on, so on a GPU): with the 40 ms budget the simulator lifts 8 DeepSeek agents from 19.2 to 23.4 tok/s (it
    # predicts DeepSeek within 1.12x) and 24 llama-8b agents past an H100's pool from 20.0 to 27.2 (uncalibrated
    # for llama-8b: the direction only; bench/results/2026-12-06-cpu-simulate-*). Measured on a GPU only at 50 ms.
    decode_payback: bool = Field(
        True,
        description="a step with prefill that ran past decode_step_budget_ms is paid back to the decoders by "
        "decode-only steps (no prefill, no admission) until they average the budget again; they then get at most "
        "one token per budget, so leave the budget headroom under the rate they need (40 ms for 20 tok/s)",
    )

    # FA4 reads a whole cold prompt's K/V as its own contiguous rows (TMA loads) but chunks after the first
    # through the pool's 16-token pages (cp.async): the attention of a cold 100K prompt, one llama-8b layer on
    # the H200, 128.1 ms in one piece against 144.8 in chunks.
    solo_prefill_tokens: int | None = Field(
        None,
        ge=0,
        description="a prompt with nothing cached, admitted when nothing else runs on the rank, is prefilled in "
        "one step up to this many tokens (past max_num_batched_tokens; the MLP still runs that many rows at a "
        "time); 0 = chunks of max_num_batched_tokens; unset: the attention backend's choice (fa4: 131072, "
        "others: 0)",
    )
    l1_restore_cost: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="cost of restoring a token from L1 relative to prefill: the router's score, and the load a "
        "rank reports in its unit",
    )

    @property
    def warm_first(self) -> bool:
        return self.scheduling_policy == "warm_first"

    def step_budget_ms(self, cuda: bool = True) -> float:
        """decode_step_budget_ms, or where unset GPU_DECODE_STEP_BUDGET_MS on CUDA and off (0) on the CPU."""
        if self.decode_step_budget_ms is not None:
            return self.decode_step_budget_ms
        return GPU_DECODE_STEP_BUDGET_MS if cuda else 0.0


class EngineConfig(BaseModel):
    """How each rank's engine is built and run (its KV pool, batch limits, kernels, L1 pacing): one section of the
    config, handed as it is to the engine (EngineSettings.engine) and the simulator's ranks; the launcher reads its
    pool sizing. Config files and KVSERVE_* variables write its keys flat (max_num_seqs: 32,
    KVSERVE_MAX_NUM_SEQS=32), or under engine:."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(
        16, gt=0, description="tokens per KV block: the unit of the pool, the prefix cache, block hashes and L1 copies"
    )
    max_num_seqs: int = Field(
        64, gt=0, description="sequences a rank runs at once; decode graphs are recorded for batch sizes up to it"
    )
    max_num_batched_tokens: int = Field(
        4096, gt=0, description="tokens one engine step takes at most (a prefill chunk's size); at least 16"
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="share of the GPU's memory a rank may use: the KV pool gets what the weights, the longest "
        "step's activation peak and the decode graphs leave; ranks sharing a GPU (kvserve up --gpus 0,0) split it",
    )
    kv_cache_memory_gb: float = Field(1.0, gt=0.0, description="KV pool size when running on the CPU")
    num_kv_blocks: int | None = Field(None, gt=0, description="fix the pool size (tests, benchmarks)")
    prefix_cache: bool = Field(
        True,
        description="L0: finished prompts keep their KV blocks on the GPU (LRU) for later requests; false: every "
        "request prefills its whole prompt, and L1 is off too",
    )
    cuda_graphs: bool = Field(
        True, description="replay decode steps from CUDA graphs, one per batch-size bucket, recorded at start-up"
    )
    pipeline_steps: bool = Field(
        True,
        description="schedule and launch each step before reading the previous one's tokens (those it needs are "
        "taken on the device), so the host's work between steps overlaps the GPU's; decode-only and mixed steps "
        "alike (H200, llama-8b: 5-8% less time per decode step)",
    )
    attention_backend: Literal["auto", "triton", "fa4", "flashinfer", "sdpa"] = Field(
        "auto",
        description="attention over the paged pool: our Triton kernels reading K/V in place (CUDA), flash-attn "
        "4's paged forward for every prefill chunk with ours for decode (SM90 GPUs: the kvserve[cuda] extra; it "
        "compiles its kernels at start-up, seconds each), FlashInfer's FA3 kernel for prefill over a cached "
        "prefix with ours for decode (the kvserve[cuda] extra with FlashInfer's prebuilt modules), or gather + "
        "SDPA (the CPU path); auto takes fa4 where it is installed on an SM90 GPU, else FlashInfer where it runs "
        "without compiling, else our kernels wherever they run, else SDPA",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="what the KV pool stores: auto = the model's dtype; fp8_e4m3 = float8 e4m3 (scale 1.0), half "
        "a bf16 pool's bytes per token, so twice the tokens; read by the sdpa path and the Triton kernels "
        "(attention_backend auto takes those on CUDA), not by fa4 or FlashInfer",
    )
    l1_offload_mb_per_step: float = Field(
        512.0,
        gt=0.0,
        description="L1 write-through copies issued per engine step on CUDA, in MiB (~10 ms of PCIe "
        "Gen5); more queue for the next steps, so a step's own token read never waits behind a whole prompt's",
    )
    # always: on the CPU probe past L1 while_room won (85% -> 98% of the optimum at 32 agents: with every block written
    # L1 was mostly a copy of L0; bench/results/2026-12-07-cpu-probe-l1-write-through-while-room/), but on the H100 at
    # 40 agents it lost (95.0% and 93.3% of the optimum against always's 98.3%): L0 evicted 16-24K blocks L1 lacked
    # against 1.8K: once writing stops, the horizon's copies (paced by l1_offload_mb_per_step) come only when L0 is
    # about to evict, and a GPU step's admissions outran them; a 16K-block horizon did no better
    # (bench/results/2026-12-07-h100-llama-8b-write-through-ab/).
    # on_evict: the simulator's bound for exclusive tiers, calibrated on the H100, passed 44-64 agents at 99.9% of the
    # optimum where always fails 44 (bench/results/2026-12-07-h100-peer-llama-8b-gauges): with write-through L1 holds
    # mostly copies of what L0 holds. On the H100 (one A/B in one lease,
    # bench/results/2026-12-08-h100-llama-8b-on-evict-ab) it passed 48 agents at 97.98% of the optimum where always
    # failed (95.67%). Off by default until repeats agree.
    l1_write_through: Literal["always", "while_room", "on_evict"] = Field(
        "always",
        description="when a rank copies its new full blocks to L1: always (L1 then holds copies of what the GPU pools "
        "hold, evicting what they let go), while_room: only while L1 has slots it need not evict for them, so "
        "once it is full it keeps what the pools let go (the eviction horizon offers it) and the tiers add up; "
        "a session a rank still holds is then in no other tier until its pool lets it go; or on_evict "
        "(exclusive tiers): never written through, each block copied when its pool evicts it and L1 lacks it, "
        "before the step that reuses it runs (the copy is in that step's way), into slots the rank reserved ahead",
    )
    l1_reserved_slots: int | None = Field(
        None,
        ge=0,
        description="with l1_write_through on_evict: L1 slots a rank holds for the blocks its pool evicts (a "
        "kvstore call is too far away to ask at eviction); evictions past them are lost; unset: twice the blocks "
        "one step takes (at least 1024)",
    )
    # Off by default until a GPU A/B says otherwise (while_room won on the CPU probe and lost on the H100). Why it
    # may help: on the H100 at 40 agents one 80K-token session was restored, its L1 copies demoted
    # (l1_evict_restored_first), and 4 s after it ended neither tier held most of it; the step's never-offered L0
    # evictions, about its size, point to a restore larger than the horizon
    # (bench/results/2026-12-07-h100-llama-8b-ours-44/).
    l1_refresh_finished: bool = Field(
        False,
        description="when a request ends, its blocks L1 holds go to L1's most recently used end (an Allocate, no "
        "copy) and those it lost are written again: L1 then keeps a session L0 has just let go idle, as it keeps "
        "one written through, where a restore had demoted its copies; with l1_write_through while_room only "
        "while L1 has room",
    )
    l1_eviction_horizon_blocks: int | None = Field(
        None,
        ge=0,
        description="the L0 cache entries next in line for eviction that are offered to L1 again "
        "(refreshed there, or copied if L1 lost them), so L1 keeps what L0 lets go; unset: twice the blocks the "
        "longest step takes (at least 1024); 0: write-through only",
    )

    @field_validator("max_num_batched_tokens")
    @classmethod
    def _batched_tokens_at_least_one_block(cls, value: int) -> int:
        if value < 16:
            raise ValueError("max_num_batched_tokens must be at least 16")
        return value

    @property
    def l1_offload_bytes_per_step(self) -> int:
        """l1_offload_mb_per_step in bytes, the L1 tier's pace."""
        return int(self.l1_offload_mb_per_step * (1 << 20))


# The config's sections: field name -> the model of its keys, which may also be written flat (_lift_sections).
SECTIONS: dict[str, type[BaseModel]] = {"engine": EngineConfig, "scheduling": SchedulingConfig}


def _lift_sections(values: dict[str, Any]) -> dict[str, Any]:
    """values with every flat key of a section (max_cold_prefills: 2) moved under it (scheduling:); a key given
    both ways is refused."""
    lifted = dict(values)
    for section, model in SECTIONS.items():
        flat = {key: lifted.pop(key) for key in model.model_fields if key in lifted}
        if not flat:
            continue
        given = lifted.get(section)
        if isinstance(given, BaseModel):
            nested = given.model_dump(exclude_unset=True)
        else:
            nested = dict(given) if isinstance(given, dict) else {}
        if both := sorted(flat.keys() & nested.keys()):
            raise ValueError(f"{', '.join(both)} given both flat and under {section}:")
        lifted[section] = {**nested, **flat}
    return lifted


class _LiftedSource(PydanticBaseSettingsSource):
    """A settings source whose flat section keys are lifted before the sources merge, so that each key's
    precedence (arguments, environment, file) holds whichever way a source writes it."""

    def __init__(self, source: PydanticBaseSettingsSource) -> None:
        super().__init__(source.settings_cls)
        self.source = source

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the whole source

    def __call__(self) -> dict[str, Any]:
        return _lift_sections(self.source())


class _FlatSectionEnv(PydanticBaseSettingsSource):
    """KVSERVE_MAX_COLD_PREFILLS and the like: a section's keys read from the environment by their flat names
    (the environment source reads top-level fields only), case-insensitively as that source does."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        prefix = str(self.config.get("env_prefix", "")).lower()
        environ = {name.lower(): value for name, value in os.environ.items()}
        found: dict[str, Any] = {}
        for section, model in SECTIONS.items():
            keys = {key: environ[prefix + key] for key in model.model_fields if prefix + key in environ}
            if keys:
                found[section] = keys
        return found


class KvServeConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSERVE_", extra="forbid", protected_namespaces=())

    # --- model ---
    model: str = Field("", description="HF directory, .gguf file or config.json (dummy); empty = embedded SmolLM2")
    served_model_name: str = Field("", description="name clients use; empty = derived from the model")
    load_format: Literal["auto", "hf", "gguf", "dummy"] = Field(
        "auto",
        description="how model is read: auto (a directory: hf, a .gguf file: gguf, a .json file: dummy), hf "
        "(safetensors directory), gguf, dummy (random weights in a config.json's shape)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the model's dtype; auto = bfloat16 on CUDA, float32 on the CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA where torch sees a GPU, else the CPU; cuda without a GPU is an error"
    )
    seed: int = Field(
        0,
        description="random weights' seed (load_format dummy); part of the weights digest in the block-hash namespace",
    )
    random_weights: Literal["normal", "uniform"] = Field(
        "normal",
        description="load_format dummy's draw: normal(0, 0.02) with norms 1, or uniform(-1e-3, 1e-3) for every "
        "parameter as vLLM's dummy loader draws (a MoE routes alike on both sides)",
    )
    max_model_len: int | None = Field(None, gt=0, description="default: the model's trained window")
    allow_long_context: bool = Field(False, description="allow max_model_len beyond the trained window")

    # --- engine (the KV pool, batch limits and kernels of each rank) ---
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="the keys of the table below, written flat (max_num_seqs: 32, KVSERVE_MAX_NUM_SEQS=32) or under "
        "engine:",
    )

    # --- scheduling (which requests each engine step runs) ---
    scheduling: SchedulingConfig = Field(
        default_factory=SchedulingConfig,
        description="the keys of the table below, written flat (max_cold_prefills: 2, KVSERVE_MAX_COLD_PREFILLS=2) "
        "or under scheduling:",
    )

    # --- L1 (kvstore) ---
    l1_cache: bool = Field(True, description="use the kvstore's L1 host cache; false: L0 only")
    l1_host_gb: float = Field(
        32.0,
        ge=0.0,
        description="the L1 arena's size, lowered to MemAvailable minus l1_headroom_gb and to the free space of "
        "l1_arena_dir (the kvstore logs why); 0 = no L1",
    )
    l1_arena_dir: str = Field("/dev/shm", description="where the kvstore creates the shared arena file")
    l1_headroom_gb: float = Field(4.0, ge=0.0, description="RAM the arena must leave to everything else")
    l1_pin_ttl_secs: float = Field(120.0, gt=0.0, description="a pin older than this is dropped (a dead copier)")
    l1_evict_restored_first: bool = Field(
        True,
        description="blocks a rank restored into its GPU pool go to the eviction end of L1 (the rank offers them "
        "again before its pool evicts them), so L1 keeps what no GPU holds and the tiers add up; false: a "
        "restored block counts as just read, the most recent",
    )
    # Off since 2026-12-06: on the H100 (llama-8b, 40 agents past the pool, one A/B in one lease) it took the cache
    # hit from 95.2% to 92.7% of the optimum, the L0 evictions L1 did not hold from 1.3% to 4.5%: the horizon's
    # copies of the spares L1 had let go fell behind L0's evictions (bench/results/
    # 2026-12-06-h100-ours-llama-8b-written-through-first). The CPU probe, whose steps are all alike, had it +1 point.
    l1_evict_written_through_first: bool = Field(
        False,
        description="blocks a rank writes through while its GPU pool holds them go to the eviction end of L1 until "
        "the rank offers them again (its eviction horizon, before the pool evicts them), so L1 holds mostly what "
        "no GPU holds, provided the horizon's copies keep up; false: a written block is the most recent",
    )
    kvstore_host: str = Field("127.0.0.1", description="where the kvstore listens")
    kvstore_port: int = Field(50141, ge=0, le=65535, description="0: kvserve up picks a free port")
    kvstore: str = Field("", description="host:port of the kvstore ranks use; empty = no L1 (L0 only)")

    # --- KV events in vLLM's format ---
    kv_events_endpoint: str = Field(
        "",
        description="where a rank also publishes its L0 KV events in vLLM's format (ZMQ PUB, medium GPU), for "
        "routers built for vLLM such as llm-d's precise prefix-cache scorer: tcp://host:port (bound; the "
        "events carry prompt token ids, unauthenticated: keep it on loopback or an internal network); empty: off",
    )
    kv_events_replay_endpoint: str = Field(
        "", description="the rank's vLLM replay socket (ZMQ ROUTER): tcp://host:port; empty: no replay"
    )
    kvstore_kv_events_endpoint: str = Field(
        "", description="the same for the kvstore's L1 events (medium CPU, no token ids): tcp://host:port; empty: off"
    )
    kvstore_kv_events_replay_endpoint: str = Field(
        "", description="the kvstore's vLLM replay socket: tcp://host:port; empty: no replay"
    )
    kv_events_topic: str = Field("", description="the ZMQ topic of every vLLM-format batch (vLLM's default: none)")
    kv_events_buffer_steps: int = Field(10_000, gt=0, description="vLLM-format batches each publisher keeps for replay")
    kv_events_encoding: Literal["map", "array"] = Field(
        "map",
        description='how each vLLM-format event is encoded: map = a msgpack map tagged by "type" (vLLM 0.24 '
        "on); array = a positional array, tag first (subscribers written for vLLM before 0.24)",
    )

    # --- router ---
    router_host: str = Field("127.0.0.1", description="where the router listens")
    router_port: int = Field(50140, ge=0, le=65535, description="0: kvserve up picks a free port")
    router: str = Field("", description="host:port of the router; empty = static rank list (rank_workers)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="the router's durable state")
    redis_password_file: str = Field("", description="file holding Redis's password (requirepass); empty = none")
    session_ttl_secs: float = Field(3600.0, gt=0.0, description="a session forgets its rank after this idle time")
    heartbeat_interval_secs: float = Field(
        1.0, gt=0.0, description="how often each rank reports its load to the router"
    )
    rank_down_after_secs: float = Field(
        3.0, gt=0.0, description="no heartbeat for this long (3 missed at the default interval): the rank is down"
    )
    # Counted as ranks report it: uncached tokens still to prefill (L1 hits at l1_restore_cost), ~1 s of llama-8b
    # prefill on an H200 at 32K. When ranks counted whole prompts, 256K was needed to keep warm turns home; in
    # uncached tokens no simulated session left at 64K or more, and 32K cut TTFT p95 at the same cache hit
    # (kvserve bench simulate, 2 ranks x 48 agents: 1.28 -> 1.12 s).
    overload_prefill_tokens: int = Field(
        32768,
        gt=0,
        description="uncached prefill tokens queued ahead of a turn beyond which a session may leave its rank",
    )

    # --- rank worker ---
    rank_worker_host: str = Field("127.0.0.1", description="where a rank worker listens")
    rank_worker_port: int = Field(
        50151,
        ge=0,
        le=65535,
        description="the first rank's port; kvserve up gives the others the next ones (0: free ports)",
    )
    rank_id: str = Field("", description="this rank's name; empty = rank-<port>")
    rank_advertise_address: str = Field("", description="host:port others use to reach this rank; empty = host:port")
    rank_max_step_secs: float = Field(
        300.0,
        gt=0.0,
        description="an engine iteration running longer is a stuck engine thread: its streams stop reporting "
        "progress, so gateways move them elsewhere (a CPU prefill chunk can take a minute)",
    )
    rank_workers: list[str] = Field(
        default_factory=list, description="static rank list host:port (without a router); empty = rank_worker_*"
    )
    request_timeout_secs: float = Field(
        600.0,
        gt=0.0,
        description="a request's deadline at the rank; past it the request ends alone (500 / event: error), not "
        "retried elsewhere",
    )
    max_waiting_requests: int = Field(256, gt=0, description="rank queue limit; beyond it: overloaded (529)")
    # The rank worker's engine thread shares the GIL with its gRPC threads, which turn every token into a
    # stream message. When it comes back from the GPU (or any call that lets the GIL go) and a gRPC thread
    # holds the GIL, CPython makes it wait up to the switch interval (5 ms by default) before forcing a
    # hand-over; under the agent load on the H200 a decode step took ~3 ms longer in the serving process than
    # on the GPU (the step log's GPU time). bench/probes/gil_wait.py reproduces that regime on the CPU (64
    # streams, a 12 ms GIL-free "GPU" step): 5.8-7.3 ms of host time per step at 5 ms, 3.8-4.3 at 0.5 ms,
    # 3.7-4.0 at 0.2. None leaves Python's interval.
    gil_switch_interval_ms: float | None = Field(
        0.5,
        gt=0.0,
        le=100.0,
        description="rank worker: sys.setswitchinterval for its process, in ms (None: Python's own, 5 ms)",
    )

    # --- expert parallelism (a MoE model's routed experts split across the ranks of a group) ---
    # Each rank of a group keeps its own sessions, scheduler and KV pool and holds attention, the dense layers
    # and the shared experts whole; the MoE layers exchange tokens across the group, so its ranks step together.
    expert_parallel_size: int = Field(
        1, ge=1, description="ranks per expert-parallel group; each holds 1/size of every MoE layer's routed experts"
    )
    expert_parallel_rank: int = Field(0, ge=0, description="this rank's place in its group (kvserve sets it)")
    expert_parallel_rendezvous: str = Field(
        "", description="host:port where a group's ranks meet (its rank 0 listens there); kvserve sets it"
    )
    expert_parallel_group: str = Field("", description="the group's name, reported to the router (kvserve sets it)")
    expert_parallel_timeout_secs: float = Field(
        10.0,
        gt=0.0,
        description="a peer of the group silent (no heartbeat) this long is dead or hung: the group's ranks exit "
        "and are restarted together, and the gateways continue the cut streams once it is back",
    )

    # --- metrics (Prometheus /metrics over HTTP on each gRPC service; the gateway serves its own on its port) ---
    kvstore_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="the kvstore's /metrics port, bound on kvstore_host; 0 = off (kvserve up and compose give it one)",
    )
    router_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="the router's /metrics port, bound on router_host; 0 = off (kvserve up and compose give it one)",
    )
    metrics_host: str = Field(
        "",
        description="where the router's, kvstore's and ranks' /metrics bind; empty: each service's own host. Set "
        "to an address a fleet's endpoint picker or Prometheus reaches (the pages are unauthenticated)",
    )
    rank_worker_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="a rank worker's /metrics port, bound on rank_worker_host (vLLM's metric names); 0 = off "
        "(kvserve up and compose give each rank one)",
    )

    # --- internal plane (router, kvstore, rank workers; the gateway and tools as their clients) ---
    internal_auth: bool = Field(
        True, description="internal gRPC calls carry the shared secret; false is allowed on loopback binds only"
    )
    internal_secret_file: str = Field(
        "", description="file holding the internal plane's shared secret (kvserve up generates one)"
    )

    # --- gateway ---
    gateway_host: str = Field(
        "127.0.0.1", description="where the gateway listens; beyond loopback only with api_keys_file"
    )
    gateway_port: int = Field(8080, ge=0, le=65535, description="0: kvserve up picks a free port")
    deployment_slug: str = Field("", description="another accepted model name, e.g. the deployment's name")
    api_keys_file: str = Field("", description="hashed API keys; empty = no auth, allowed on loopback only")
    max_request_bytes: int = Field(
        32 * 1024 * 1024, gt=0, description="request bodies larger than this get 413, refused without being read whole"
    )
    body_budget_bytes: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description="large request bodies (1 MB and up) held at once, in bytes of JSON (their objects take 30-55x "
        "that in memory): a body waits for its share before it is read and keeps it until its answer ends; a body "
        "larger than this goes alone",
    )
    body_queue_limit: int = Field(
        64, ge=0, description="bodies that may wait for body_budget_bytes; past it: overloaded (529)"
    )
    body_queue_wait_secs: float = Field(
        60.0, gt=0.0, description="a body that waits longer than this for body_budget_bytes: overloaded (529)"
    )
    ping_interval_secs: float = Field(5.0, gt=0.0, description="SSE ping cadence while a long prefill runs")
    rank_stall_secs: float = Field(
        5.0,
        gt=0.0,
        description="a rank that sends nothing (no token, no progress) for this long, or does not accept a request "
        "within it, is hung: the request continues on another rank",
    )
    rank_recovery_wait_secs: float = Field(
        120.0,
        gt=0.0,
        description="how long a cut stream (and a new request) waits for a rank to come back when none can take it "
        "now (a rank or expert-parallel group restarting); pings keep a stream alive meanwhile, then it fails as it "
        "would without the wait",
    )
    log_prompts: bool = Field(False, description="put prompt text in logs (off: privacy)")
    # An agent resends its conversation every call: 160-545K tokens took the gateway 0.4-1.5 s to tokenize per
    # call at Claude Code's real size (2026-12-06). The ids of each message's text are kept (gateway/prompt/
    # segment_cache.py), ~4 bytes a token.
    tokenize_cache_tokens: int = Field(
        TOKENIZE_CACHE_TOKENS,
        ge=0,
        description="the gateway keeps the token ids of prompts' messages up to this many tokens, least recently "
        "used out first, and tokenizes only a call's new messages; 0 = tokenize every prompt whole",
    )
    request_read_timeout_secs: float = Field(
        30.0, gt=0.0, description="a request's headers, and then its body, must arrive within this; else 408"
    )
    metrics_public: bool = Field(
        False, description="serve /metrics without an API key when keys are on (else a key with the metrics scope)"
    )
    default_temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="for requests that send none (Claude Code does not); None = 1.0"
    )
    default_top_p: float | None = Field(None, gt=0.0, le=1.0, description="for requests that send none")

    @model_validator(mode="before")
    @classmethod
    def _flat_section_keys(cls, data: Any) -> Any:
        # Built without the settings sources (model_validate): flat keys are lifted here.
        return _lift_sections(data) if isinstance(data, dict) else data

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings, _FlatSectionEnv(settings_cls)]
        config_file = os.environ.get("KVSERVE_CONFIG", "")
        if config_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(_LiftedSource(source) for source in sources)


def load_config(config_file: str | Path | None = None, **overrides: Any) -> KvServeConfig:
    """Read the configuration; a named file that does not exist is an error, not a silent default."""
    named = str(config_file) if config_file is not None else os.environ.get("KVSERVE_CONFIG", "")
    if named and not Path(named).is_file():
        raise FileNotFoundError(f"config file not found: {named}")
    previous = os.environ.get("KVSERVE_CONFIG")
    if config_file is not None:
        os.environ["KVSERVE_CONFIG"] = named  # the settings source reads the file name from here
    try:
        return KvServeConfig(**overrides)
    finally:
        if config_file is not None:
            if previous is None:
                del os.environ["KVSERVE_CONFIG"]
            else:
                os.environ["KVSERVE_CONFIG"] = previous


# The documented defaults, for code that needs them without a file or the environment (the simulator's node,
# the router's scoring policy when built without a config).
DEFAULTS = KvServeConfig.model_construct()

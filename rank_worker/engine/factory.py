"""Build an engine rank from the configuration: open the model files, place the model, size the KV pool."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from contracts.config import EngineConfig, KvServeConfig, SchedulingConfig
from rank_worker.engine.decode_graphs import DecodeGraphs
from rank_worker.engine.model_runner import kv_block_bytes
from rank_worker.engine.paged_engine import EngineSettings, PagedEngine, solo_prefill_tokens
from rank_worker.expert_parallel.attach import join_group
from rank_worker.expert_parallel.group import ExpertGroup
from rank_worker.expert_parallel.shard import WHOLE, ExpertShard
from rank_worker.l1.kvstore_client import KvStoreClient
from rank_worker.model.attention.kv_quant import check_backend, pool_dtype
from rank_worker.model.causal_lm import CausalLM
from rank_worker.model.llama import RANDOM_INIT_SCHEMES
from rank_worker.model.moe import MoE
from rank_worker.model.registry import model_classes
from rank_worker.model_files.opener import open_model_source
from rank_worker.model_files.source import ModelSource, SkipTensor
from rank_worker.model_files.weights_digest import random_weights_digest

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(setting: str) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but torch sees no CUDA device")
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[setting]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_max_model_len(config: KvServeConfig, trained: int) -> int:
    wanted = config.max_model_len or trained
    if wanted > trained:
        if not config.allow_long_context:
            raise ValueError(
                f"max_model_len {wanted} exceeds the model's trained window of {trained} tokens; "
                f"set allow_long_context: true to run past it anyway (quality degrades)"
            )
        log.warning("max_model_len %d runs past the model's trained window of %d tokens", wanted, trained)
    return wanted


def build_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    seed: int,
    random_weights: str = "normal",
    shard: ExpertShard = WHOLE,
) -> CausalLM:
    """The model of source's config.json (its family's classes: model/registry.py), its features checked before
    any weight is read (a refusal takes a second), then loaded or given random weights. shard: the routed experts
    this rank holds in an expert-parallel group; only their tensors are read (random ones: the whole model's rows)."""
    classes = model_classes(source.hf_config)
    cfg = classes.config.for_serving(source.hf_config, max_positions)  # UnsupportedModelError naming what is not
    if not shard.whole:
        _check_moe(shard, cfg.n_routed_experts, source.model_id)
    with _default_dtype(dtype), torch.device(device):
        model = classes.model(cfg, max_positions=max_positions, shard=shard)
    if source.load_weights is None:
        log.info("random weights (load_format dummy), seed %d, %s", seed, random_weights)
        model.init_random_weights(seed, random_weights)
    else:
        skip: SkipTensor | None = None if shard.whole else model.skipped_by_shard
        model.load_hf_weights(source.load_weights(skip))
    log.info("%s", weight_memory(model, shard))
    return model.eval()


def _check_moe(shard: ExpertShard, n_routed: int, model_id: str) -> None:
    if not n_routed:
        raise ValueError(
            f"expert parallelism needs a MoE model (routed experts to split): {model_id} has none; "
            f"set expert_parallel_size 1 (it is {shard.size})"
        )
    shard.check(n_routed)


def weight_memory(model: nn.Module, shard: ExpertShard = WHOLE) -> str:
    """A line for the start-up log: the parameter bytes on the model's device, and for a rank of an
    expert-parallel group its share of the routed experts and what the whole model takes."""
    held = sum(param.numel() * param.element_size() for param in model.parameters())
    line = f"weights: {held / 1e9:.2f} GB on {next(model.parameters()).device}"
    if shard.whole:
        return line
    routed = 0  # the routed experts' rows of every expert stack held here (the shared experts' rows follow them)
    for module in model.modules():
        if isinstance(module, MoE):
            for param in module.parameters(recurse=False):
                routed += len(module.routed) * param[0].numel() * param.element_size()
    return (
        f"{line} (expert-parallel rank {shard.rank} of {shard.size}: 1/{shard.size} of the routed experts, "
        f"{routed / 1e9:.2f} GB; the whole model takes {(held + routed * (shard.size - 1)) / 1e9:.2f} GB)"
    )


def weights_digest(source: ModelSource, seed: int, device: torch.device, random_weights: str = "normal") -> str:
    """What defines the weights this rank runs, for the block-hash namespace: the files' digest, or for random
    weights the config's digest with the seed and device that drew them."""
    if source.load_weights is not None:
        return source.weights_digest
    return random_weights_digest(source.weights_digest, seed, device.type, RANDOM_INIT_SCHEMES[random_weights])


def size_kv_pool(
    config: KvServeConfig, model: CausalLM, device: torch.device, dtype: torch.dtype, max_model_len: int
) -> int:
    """Blocks that fit: a fixed count if configured; on CUDA what gpu_memory_utilization leaves after weights,
    the activation peak of a full-size step and the memory decode graphs hold; on the CPU kv_cache_memory_gb.
    Blocks are sized in the pool's dtype (kv_cache_dtype): an fp8 pool holds 2x a bf16 one's blocks."""
    engine = config.engine
    block_bytes = kv_block_bytes(model, engine.block_size, pool_dtype(engine.kv_cache_dtype, dtype))
    if engine.num_kv_blocks:
        return engine.num_kv_blocks
    if device.type != "cuda":
        return max(int(engine.kv_cache_memory_gb * 1024**3) // block_bytes, 1)
    peak = _profile_peak_bytes(config, model, device, dtype, max_model_len)
    peak += _decode_graph_bytes(engine, model, max_model_len)
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * engine.gpu_memory_utilization) - peak
    if budget < block_bytes:
        raise RuntimeError(
            f"no room for a KV pool: {peak / 1e9:.1f} GB used by weights and activations out of "
            f"{engine.gpu_memory_utilization:.0%} of {total / 1e9:.1f} GB"
        )
    return budget // block_bytes


def _profile_peak_bytes(
    config: KvServeConfig, model: CausalLM, device: torch.device, dtype: torch.dtype, max_model_len: int
) -> int:
    """Run the longest step the rank will take (a prefill of max_num_batched_tokens, or a solo prefill's longer
    one) through a throwaway pool and read the allocator's peak, less that pool (the real one replaces it). Where
    the backend's prefill over a prefix allocates per context token (MLA), a second chunk as long over that first
    one's prefix too: its context windows and their merge (mla_windows.py) are then in the peak."""
    engine = config.engine
    kv_dtype = pool_dtype(engine.kv_cache_dtype, dtype)
    backend = model.choose_attention(check_backend(engine.attention_backend, kv_dtype), device, dtype, kv_dtype)
    limits = EngineSettings(num_blocks=1, max_model_len=max_model_len, engine=engine, scheduling=config.scheduling)
    tokens = max(engine.max_num_batched_tokens, solo_prefill_tokens(limits, backend))
    # two chunks of `tokens` (the first cold) where a chunk over a prefix costs more than a cold one, as far as
    # max_model_len lets a context pass the first chunk
    prompt = max(tokens, min(2 * tokens, max_model_len)) if backend.prefix_expands else tokens
    chunk = {"max_num_batched_tokens": tokens} if prompt > tokens else {}
    settings = EngineSettings(
        num_blocks=-(-prompt // engine.block_size) + 1,
        max_model_len=prompt + 1,
        # the rank's block and chunk size and the peak of the kernels it will run; a prefill-only probe without
        # caching (the graphs' share is measured apart), its other keys the defaults
        engine=EngineConfig(
            **engine.model_dump(include={"block_size", "max_num_batched_tokens", "attention_backend", "kv_cache_dtype"})
            | chunk,
            prefix_cache=False,
            cuda_graphs=False,
        ),
        # the engine resolves it to 0 where tokens is max_num_batched_tokens
        scheduling=SchedulingConfig(solo_prefill_tokens=tokens),
    )
    from rank_worker.engine.interface import EngineRequest, SamplingParams

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe = PagedEngine(model, settings)
    probe.add_request(EngineRequest("profile", [1] * prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    run_probe(probe, tokens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - probe.kv_cache.numel() * probe.kv_cache.element_size()
    del probe
    torch.cuda.empty_cache()
    return peak


def run_probe(probe: PagedEngine, tokens: int) -> None:
    """Step the sizing probe to its end. A serving engine drops a step that runs out of memory and goes on with
    shorter ones (step_token_cap.py); the probe must not: its peak would be a shorter step's, and the pool sized
    after it too large for the steps the rank will take."""
    while probe.has_unfinished():
        probe.step()
        if probe.step_cap.dropped_steps:
            raise RuntimeError(
                f"the rank's longest step ({tokens} tokens) runs out of GPU memory beside the weights alone: "
                "lower max_num_batched_tokens, or solo_prefill_tokens where it is past it"
            )


def build_random_model(config_json: str, max_positions: int, seed: int = 0) -> CausalLM:
    """Random weights in the shape of a config.json, bf16 on the GPU when there is one, else float32 on the CPU:
    the model benchmarks and probes time."""
    device = resolve_device("auto")
    return build_model(
        open_model_source(config_json, "dummy"), device, resolve_dtype("auto", device), max_positions, seed
    )


def _decode_graph_bytes(engine: EngineConfig, model: CausalLM, max_model_len: int) -> int:
    """What decode graphs keep for themselves: their static buffers and the activations of the largest graph
    (graphs share one memory pool, so it grows to the largest one's peak, and eager steps cannot use it).
    Measured by running that step eagerly in a throwaway engine of one block (its graphs set up as a serving
    engine's are): the padded rows' shapes, not their data, set the size."""
    if not engine.cuda_graphs:
        return 0
    device = model.embed_tokens.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    settings = EngineSettings(
        num_blocks=1,
        max_model_len=max_model_len,
        # the rank's blocks, batch and kernels, its other keys the defaults; the largest bucket is run eagerly below
        # (cuda_graphs off): the same buffers and activations
        engine=EngineConfig(
            **engine.model_dump(include={"block_size", "max_num_seqs", "attention_backend", "kv_cache_dtype"}),
            prefix_cache=False,
            cuda_graphs=False,
        ),
    )
    probe = PagedEngine(model, settings)
    if not probe.attention.graph_safe:
        return 0
    graphs = DecodeGraphs(model, probe.kv_cache, probe.runner.inputs, engine.max_num_seqs, capture=False)
    largest = max(graphs.buckets)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        probe.runner.inputs.fill_padding(largest)
        graphs.forward(largest)
    torch.cuda.synchronize(device)
    reserved = torch.cuda.max_memory_allocated(device) - before
    del probe, graphs
    torch.cuda.empty_cache()
    log.info("decode graphs: %.2f GB held for batches up to %d", reserved / 1e9, largest)
    return reserved


def build_engine(
    config: KvServeConfig, l1_client: KvStoreClient | None = None, group: ExpertGroup | None = None
) -> PagedEngine:
    """Everything a rank worker needs at start: model files checked first, then weights, then the pool, then
    the L1 tier over l1_client (None: L0 only). group: the rank's expert-parallel group, formed (its MoE layers
    exchange across it from the first forward: the pool's sizing probes run on every rank alike)."""
    source = open_model_source(config.model, config.load_format)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    trained = int(source.hf_config.get("max_position_embeddings", 2048))
    max_model_len = resolve_max_model_len(config, trained)
    shard = ExpertShard(config.expert_parallel_rank, config.expert_parallel_size)
    model = build_model(source, device, dtype, max_model_len, config.seed, config.random_weights, shard)
    digest = weights_digest(source, config.seed, device, config.random_weights)
    log.info("model %s: weights digest %s (part of the KV-cache namespace)", source.model_id, digest)
    lockstep = join_group(model, group) if group is not None else None
    num_blocks = size_kv_pool(config, model, device, dtype, max_model_len)
    capacity = num_blocks * config.engine.block_size
    if max_model_len > capacity:
        log.warning(
            "max_model_len lowered from %d to %d: one sequence must fit in the KV pool", max_model_len, capacity
        )
        max_model_len = capacity
    kv_dtype = pool_dtype(config.engine.kv_cache_dtype, dtype)
    block_bytes = kv_block_bytes(model, config.engine.block_size, kv_dtype)
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.2f GB on %s (%s)",
        num_blocks,
        config.engine.block_size,
        capacity,
        num_blocks * block_bytes / 1e9,
        device,
        kv_dtype,
    )
    budget_ms = decode_step_budget_ms(config, device)
    # in the log, so that a benchmark's logs show the scheduling a run had (its defaults differ by device and date)
    policy = config.scheduling
    log.info(
        "scheduling: %s, decode step budget %s, decode payback %s, min prefill chunk %d tokens",
        policy.scheduling_policy,
        f"{budget_ms:g} ms" if budget_ms > 0 else "off",
        "on" if policy.decode_payback else "off",
        policy.min_prefill_chunk_tokens,
    )
    settings = EngineSettings(
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        trained_context_len=trained,
        served_model_name=config.served_model_name or _default_served_name(source.model_id),
        model_id=source.model_id,
        weights_digest=digest,
        engine=config.engine,
        scheduling=config.scheduling.model_copy(update={"decode_step_budget_ms": budget_ms}),
    )
    return PagedEngine(model, settings, source.tokenizer, l1_client, lockstep=lockstep)


def decode_step_budget_ms(config: KvServeConfig, device: torch.device) -> float:
    """The configured budget, or where unset GPU_DECODE_STEP_BUDGET_MS on CUDA and off on the CPU."""
    return config.scheduling.step_budget_ms(cuda=device.type == "cuda")


def _default_served_name(model_id: str) -> str:
    return model_id.lower().replace(" ", "-").replace("/", "-")

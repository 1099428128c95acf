"""The engine-level measures of the side-by-side benchmark against vLLM: their names, sizes and how each is
timed, so that bench/engine.py (kvserve) and bench/peer_vllm.py (vLLM's offline API) measure the same set and
write it under the same JSON keys, and bench/peer_results.py compares them.

Three kinds, each timed from submission until the last token is back (after a device synchronize):
- cold:   a fresh random prompt of `new` tokens, one output token (prefill, or TTFT of a conversation nobody
          has cached).
- warm:   a prefix of `cached` tokens primed once, then prefix + `new` fresh tokens, one output token (a warm
          prefill, or the TTFT of a conversation's next turn).
- decode: `batch` prompts of `context` tokens primed once, then the same prompts (all but a block cached) timed
          with 1 and with 1 + `steps` output tokens: seconds per decode step = (t(1 + steps) - t(1)) / steps.
Every measure's `seconds` is the median of `repeats` samples, after one warm-up request. The prompts are
random token ids drawn here, from a stream per measure seeded by its name (Prompts), so both engines get the
same ids whichever measures run (each entry records their sha-256 as `prompt_sha256`, which
bench/peer_results.py compares). Pure Python: both
engines' scripts import it (vLLM's runs in vLLM's own site, without our packages).
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from simulator.model_cost import prefill_flops

PEAK_BF16_FLOPS = 783e12  # measured on the H200 (../shared/design/performance.md)
SCHEMA = "kvserve-peer-engine/1"


@dataclass(frozen=True)
class Measure:
    name: str
    kind: Literal["cold", "warm", "decode"]
    new: int = 0  # cold: the whole prompt; warm: the tokens after the cached prefix
    cached: int = 0  # warm: the primed prefix
    batch: int = 0  # decode: sequences stepped together
    context: int = 0  # decode: each sequence's prompt
    steps: int = 0  # decode: steps timed


@dataclass(frozen=True)
class Plan:
    measures: tuple[Measure, ...]
    repeats: int
    warmup_tokens: int

    @property
    def max_model_len(self) -> int:
        longest = max(max(m.new + m.cached, m.context + m.steps + 1) for m in self.measures)
        return max(longest, self.warmup_tokens + 1) + 64  # the warm-up prompt must fit too (a decode-only plan)


def _plan(k: int, decode_context: int, decode_steps: int, repeats: int) -> Plan:
    """The full plan's sizes in units of k tokens (k = 1024 on the GPU); names keep the full plan's sizes."""
    ctx_100 = 100_000 if k == 1024 else 100 * k  # 100K is the long context of the performance notes
    measures = (
        Measure("prefill_cold_8k", "cold", new=8 * k),
        Measure("prefill_warm_8k_over_32k", "warm", new=8 * k, cached=32 * k),
        Measure("ttft_warm_32k_1k", "warm", new=k, cached=32 * k),
        Measure("ttft_cold_32k_1k", "cold", new=33 * k),
        Measure("prefill_warm_4k_over_100k", "warm", new=4 * k, cached=ctx_100),
        Measure("ttft_warm_100k_1k", "warm", new=k, cached=ctx_100),
        Measure("ttft_cold_100k_1k", "cold", new=ctx_100 + k),
        *(
            Measure(f"decode_4k_b{batch}", "decode", batch=batch, context=decode_context, steps=decode_steps)
            for batch in (1, 16, 64, 128)
        ),
        # a few sequences at a coding agent's context (its turns run at 60-100K tokens): the decode attention
        # over long contexts, which the 4K rows hardly read (issue 34: per-agent decode there ran at ~0.5x
        # vLLM's); 4 x 64K fits beside llama-8b's weights on an H100
        Measure("decode_64k_b4", "decode", batch=4, context=64 * k, steps=decode_steps),
    )
    return Plan(measures=measures, repeats=repeats, warmup_tokens=8 * k)


# 5 repeats: the ratios near their 0.9 target are decided by their medians
FULL = _plan(1024, decode_context=4096, decode_steps=64, repeats=5)
QUICK = _plan(16, decode_context=32, decode_steps=4, repeats=1)  # a CPU smoke run of the same code paths
MEASURE_NAMES = tuple(m.name for m in FULL.measures)


def plan_for(quick: bool) -> Plan:
    return QUICK if quick else FULL


def record(measure: Measure, samples: list[float], **observed: Any) -> dict[str, Any]:
    """One measure's entry in a result file: the sizes, the median and the samples, and what was observed
    (cached_tokens the engine reported for a warm request, the two decode timings)."""
    return {**asdict(measure), "seconds": statistics.median(samples), "samples": samples, **observed}


def distinct_tokens(outputs: list[list[int]]) -> dict[str, float] | None:
    """How many different token ids a decode batch produced at each output position (mean, min, max over the
    positions). On random weights the rows' tokens can collapse onto a few ids, and a MoE's rows then pick the
    same experts: a step reads far fewer expert weights than real text makes it read."""
    positions = min((len(tokens) for tokens in outputs), default=0)
    if not positions:
        return None
    counts = [len({tokens[i] for tokens in outputs}) for i in range(positions)]
    return {"mean": statistics.fmean(counts), "min": min(counts), "max": max(counts), "batch": len(outputs)}


def decode_step_samples(first_only: list[float], with_steps: list[float], steps: int) -> list[float]:
    """Seconds per decode step from paired timings of the same prompts with 1 and 1 + steps output tokens."""
    return [(full - first) / steps for first, full in zip(first_only, with_steps, strict=True)]


class Prompts:
    """Random token ids below vocab_size from a stream seeded by a name (random.Random seeds a str through
    sha-512: the same on every machine and Python), so a measure's prompts are the same lists on every engine and
    whichever other measures run. `digest()` hashes what was drawn, for the result file."""

    def __init__(self, vocab_size: int, seed: str) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self._hash = hashlib.sha256()

    def __call__(self, length: int) -> list[int]:
        ids = [self.rng.randrange(self.vocab_size) for _ in range(length)]
        self._hash.update(b",".join(str(i).encode() for i in ids) + b";")
        return ids

    def digest(self) -> str:
        return self._hash.hexdigest()


class PeerEngine(Protocol):
    """What run_plan needs of an engine: a timed batch of requests."""

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        """Submit every prompt together (temperature 0, exactly max_tokens output tokens each) and wait for
        all: the seconds it took (after a device synchronize) and each request's prefix-cached tokens. The
        output token ids of that run, per prompt in order, are left in `last_outputs`."""
        ...

    @property
    def last_outputs(self) -> list[list[int]]: ...


def run_plan(
    plan: Plan,
    engine: PeerEngine,
    vocab_size: int,
    done: Callable[[str, dict[str, Any]], None],
    after_decode: Callable[[Measure, list[list[int]]], None] | None = None,
    seed: str = "peer-plan-1",
) -> dict[str, dict[str, Any]]:
    """Every measure of the plan in order, the same way and with the same prompts for every engine;
    done(name, entry) after each (to write partial results); after_decode(measure, prompts) may time more over a
    decode measure's cached prompts. Warm measures over one prefix length share its priming (one cold prefill of
    the prefix, drawn from a stream of its own, so a measure's ids do not depend on which measures ran before)."""
    engine.run([Prompts(vocab_size, f"{seed}:warmup")(plan.warmup_tokens)], 1)  # kernels, allocator, compilation
    primed: dict[int, list[int]] = {}
    prefix_digest: dict[int, str] = {}
    entries: dict[str, dict[str, Any]] = {}
    for m in plan.measures:
        prompt = Prompts(vocab_size, f"{seed}:{m.name}")
        if m.kind == "cold":
            runs = [engine.run([prompt(m.new)], 1) for _ in range(plan.repeats)]
            entry = record(m, [t for t, _ in runs], cached_tokens=max(c[0] for _, c in runs))
        elif m.kind == "warm":
            if m.cached not in primed:
                prefix = Prompts(vocab_size, f"{seed}:prefix:{m.cached}")
                primed[m.cached] = prefix(m.cached)
                prefix_digest[m.cached] = prefix.digest()
                engine.run([primed[m.cached]], 1)
            runs = [engine.run([primed[m.cached] + prompt(m.new)], 1) for _ in range(plan.repeats)]
            entry = record(m, [t for t, _ in runs], cached_tokens=min(c[0] for _, c in runs))
        else:
            prompts = [prompt(m.context) for _ in range(m.batch)]
            engine.run(prompts, 1)  # prime: every prompt in the cache, so both timings below prefill one block
            first_only: list[float] = []
            with_steps: list[float] = []
            for _ in range(plan.repeats):
                first_only.append(engine.run(prompts, 1)[0])
                with_steps.append(engine.run(prompts, 1 + m.steps)[0])
            spread = distinct_tokens(engine.last_outputs)  # of the last timed run with steps
            if after_decode is not None:
                after_decode(m, prompts)
            samples = decode_step_samples(first_only, with_steps, m.steps)
            entry = record(m, samples, first_only_s=first_only, with_steps_s=with_steps, distinct_tokens=spread)
        entry["prompt_sha256"] = prompt.digest()
        if m.kind == "warm":
            entry["prefix_sha256"] = prefix_digest[m.cached]
        entries[m.name] = entry
        done(m.name, entry)
    return entries


def mfu(config: dict[str, Any], entry: dict[str, Any]) -> float | None:
    """Model FLOP utilisation of a cold or warm entry (None for decode, which is bandwidth-bound)."""
    if entry.get("kind") not in ("cold", "warm") or not entry.get("seconds"):
        return None
    return prefill_flops(config, entry["new"], entry.get("cached", 0)) / entry["seconds"] / PEAK_BF16_FLOPS


def write_partial(path: str | Path, result: dict[str, Any]) -> None:
    """Rewrite the result file after every measure, so a run cut short still leaves what it finished."""
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)

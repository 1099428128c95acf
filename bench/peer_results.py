"""Assemble a side-by-side run's peer.json, kvserve beside vLLM 0.25 on one GPU, from the raw files of
bench/peer_h200.sh (copied as they came back into the run folder's raw/: its tarballs and JSONs, in any folders),
print the tables and draw the charts beside it. A run folder is bench/results/<date>-<machine>-peer-<shape>/.

Engine level: per measure of bench/peer_plan.py both sides' seconds and ratio = vLLM seconds / kvserve seconds
(a speed ratio: above 1 kvserve is faster), against the target of 0.95. Agent level: per agent count both sides'
TTFT p50/p95, per-agent tok/s p50/p10, per-request tok/s p10 (when the load generator wrote it), cache hit and
the verdict against the pass bar, the largest passing count of each side and their ratio (kvserve over vLLM).

    python bench/peer_results.py --raw bench/results/2026-12-03-h200-peer-llama-8b/raw --commit 1a2b3c4
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import re
import statistics
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer_plan import MEASURE_NAMES, mfu  # noqa: E402
from loadgen import report  # noqa: E402

CACHE_HIT_OF_OPTIMUM = report.Thresholds.cache_hit_of_optimum  # the load generator's pass bar, one definition
TARGET = 0.95  # kvserve must reach 95% of vLLM's engine speed (issue 13; the DeepSeek shape's is 0.9: --target)
# A ratio within NEAR_TARGET of its target is judged over at least REPEATS_NEAR_TARGET runs a side (issue 34)
NEAR_TARGET = 0.05
REPEATS_NEAR_TARGET = 5
SIDES = ("ours", "vllm")
ENGINE_FILES = {"ours": "ours-engine.json", "vllm": "vllm-engine.json"}
STEP_FILE = re.compile(r"^(?P<side>ours|vllm)-agents-(?P<agents>\d+)\.json$")
# bench/peer_h200.sh's marker of a step stopped at STEP_MAX: the side could not finish it, so it fails.
UNFINISHED_FILE = re.compile(r"^(?P<side>ours|vllm)-agents-(?P<agents>\d+)\.unfinished\.json$")
# What this script reads of an engine result file (bench/engine.py, bench/peer_vllm.py) and of each measure.
ENGINE_KEYS = ("schema", "engine", "date", "commit", "gpu", "shape", "dtype", "settings", "measures")
MEASURE_KEYS = ("name", "kind", "new", "cached", "batch", "context", "steps", "seconds", "samples")
SIZE_KEYS = ("kind", "new", "cached", "batch", "context", "steps")
STEP_KEYS = ("agents", "ttft_p50", "ttft_p95", "tok_s_p50", "tok_s_p10", "cache_hit", "errors", "passed", "failed")
STEP_OPTIONAL = (
    "request_tok_s_p10",
    "request_tok_s_p50",
    "expected_cache_hit",
    "requests",
    "wall_s",
    "ttft_p95_warm",
    "ttft_p95_cold",
    "short_outputs",
)


def engine_keys_missing(result: dict[str, Any]) -> list[str]:
    """The keys of ENGINE_KEYS, MEASURE_NAMES and MEASURE_KEYS an engine result lacks (empty: it is complete)."""
    missing = [key for key in ENGINE_KEYS if key not in result]
    measures = result.get("measures", {})
    for name in MEASURE_NAMES:
        if name not in measures:
            missing.append(f"measures.{name}")
            continue
        missing += [f"measures.{name}.{key}" for key in MEASURE_KEYS if key not in measures[name]]
    return missing


def raw_documents(raw: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(file name, where, JSON) of every .json under raw and inside every .tar.gz there."""
    for path in sorted(raw.rglob("*")):
        if path.suffix == ".json" and path.is_file():
            try:
                yield path.name, str(path), json.loads(path.read_text())
            except ValueError:
                continue  # a file cut off mid-write
        elif path.name.endswith(".tar.gz"):
            with tarfile.open(path) as tar:
                for member in tar.getmembers():
                    if member.isfile() and member.name.endswith(".json"):
                        data = tar.extractfile(member)
                        try:
                            doc = json.loads(data.read()) if data else None
                        except ValueError:
                            continue
                        if isinstance(doc, dict):
                            yield Path(member.name).name, f"{path}:{member.name}", doc


def collect(raw: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[int, dict[str, Any]]]]:
    """The best engine result per side (most measures, then the float32 match, then the later date) and
    the best step per side and agent count (a finished step, then the later date): cumulative tarballs and
    repeated runs hold several copies of one file."""
    engines: dict[str, dict[str, Any]] = {}
    steps: dict[str, dict[int, dict[str, Any]]] = {side: {} for side in SIDES}

    def engine_rank(doc: dict[str, Any]) -> tuple:
        return (len(doc.get("measures", {})), "warm_cold_match_float32" in doc, str(doc.get("date", "")))

    for name, where, doc in raw_documents(raw):
        for side, file_name in ENGINE_FILES.items():
            if name == file_name and (side not in engines or engine_rank(doc) >= engine_rank(engines[side])):
                engines[side] = {**doc, "source": where}
        match = STEP_FILE.match(name)
        if match and doc.get("steps"):
            side, agents = match["side"], int(match["agents"])
            step = {**doc["steps"][0], "run": _run_settings(doc), "source": where}
            held = steps[side].get(agents)
            if held is None or held.get("unfinished") or str(doc.get("date", "")) >= held["run"]["date"]:
                steps[side][agents] = step
        match = UNFINISHED_FILE.match(name)
        if match and int(match["agents"]) not in steps[match["side"]]:
            steps[match["side"]][int(match["agents"])] = unfinished_step(doc, where)
    return engines, steps


def unfinished_step(marker: dict[str, Any], where: str) -> dict[str, Any]:
    """A step the side did not finish within STEP_MAX seconds: failed, with no measures (a finished run of the
    same step, in any file, takes its place)."""
    return {
        "agents": marker["agents"],
        "passed": False,
        "failed": [f"unfinished in {marker['step_max_s']} s"],
        "requests": 0,
        "unfinished": True,
        "run": {"date": marker.get("date"), "seed": marker.get("seed")},
        "source": where,
    }


def _run_settings(doc: dict[str, Any]) -> dict[str, Any]:
    keys = ("date", "api", "model", "context_scale", "turns", "think_time", "max_output_tokens", "ignore_eos", "seed")
    # provenance: the checkout the load generator ran from (loadgen/provenance.py), on our side also the code served
    return {key: doc.get(key) for key in keys} | {
        "trace": (doc.get("workload") or {}).get("trace"),
        "provenance": doc.get("provenance"),
    }


def step_provenance(steps: dict[int, dict[str, Any]]) -> Any:
    """What a side's agent steps say they ran (commit and diff hash): one value, or every distinct one in the
    order of their agent counts when the steps ran different code (None when no step file records it)."""
    seen: list[Any] = []
    for _, step in sorted(steps.items()):
        value = step.get("run", {}).get("provenance")
        if value is not None and value not in seen:
            seen.append(value)
    return seen[0] if len(seen) == 1 else (seen or None)


def _gpu_named(raw: Path) -> str | None:
    """The card bench/peer_h200.sh named in raw/gpu.txt (nvidia-smi's name), for agent steps with no engine file."""
    path = raw / "gpu.txt"
    return (path.read_text().strip().splitlines() or [None])[0] if path.is_file() else None


# `vllm serve` logs the arguments it was started with as one line holding a dict literal (api_utils.py in 0.25)
VLLM_ARGS_LINE = re.compile(r"non-default args: (?P<args>\{.*\})\s*$")


def vllm_serve_args(raw: Path) -> dict[str, Any] | None:
    """The non-default arguments `vllm serve` logged in raw's vllm-serve*.log[.gz] (the first one found): which of
    vLLM's variants ran (--kv-offloading-size, max_num_batched_tokens), when no engine file says it."""
    for path in sorted(raw.rglob("vllm-serve*.log*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", errors="replace") as log:
            for line in log:
                found = VLLM_ARGS_LINE.search(line)
                if found:
                    try:
                        return ast.literal_eval(found["args"])
                    except (ValueError, SyntaxError):
                        break  # a line cut off: the next log may hold it whole
    return None


def shape_config(shape: str) -> dict[str, Any] | None:
    path = ROOT / "bench" / "shapes" / shape / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def engine_rows(engines: dict[str, dict[str, Any]], target: float = TARGET) -> list[dict[str, Any]]:
    """One row per measure either side has: both sides' seconds, the speed ratio and the target verdict."""
    ours = engines.get("ours", {}).get("measures", {})
    vllm = engines.get("vllm", {}).get("measures", {})
    config = shape_config(engines.get("ours", engines.get("vllm", {})).get("shape", "llama-8b"))
    rows = []
    for name in [*MEASURE_NAMES, *sorted((set(ours) | set(vllm)) - set(MEASURE_NAMES))]:
        a, b = ours.get(name), vllm.get(name)
        if a is None and b is None:
            continue
        sizes = a or b
        row: dict[str, Any] = {"measure": name, **{key: sizes.get(key) for key in SIZE_KEYS}}
        row["sizes_match"] = a is not None and b is not None and all(a.get(k) == b.get(k) for k in SIZE_KEYS)
        # the same token ids on both sides (bench/peer_plan.py's Prompts); None where a file predates the digest
        digests = [entry.get("prompt_sha256") if entry else None for entry in (a, b)]
        row["same_prompts"] = None if None in digests else digests[0] == digests[1]
        for side, entry in (("ours", a), ("vllm", b)):
            seconds = entry.get("seconds") if entry else None
            row[f"{side}_s"] = seconds
            row[f"{side}_mfu"] = mfu(config, entry) if config and entry and seconds and seconds > 0 else None
            if entry and entry.get("kind") == "warm":
                row[f"{side}_cached_tokens"] = entry.get("cached_tokens")
        usable = all(row[f"{side}_s"] is not None and row[f"{side}_s"] > 0 for side in SIDES)
        comparable = usable and row["sizes_match"] and row["same_prompts"] is not False
        row["ratio"] = row["vllm_s"] / row["ours_s"] if comparable else None
        row["meets_target"] = None if row["ratio"] is None else row["ratio"] >= target
        if sizes.get("kind") == "decode" and usable:
            row["ours_tok_s"] = sizes["batch"] / row["ours_s"]
            row["vllm_tok_s"] = sizes["batch"] / row["vllm_s"]
        rows.append(row)
    return rows


ENGINE_RUN_FILE = re.compile(r"^(?P<side>ours|vllm)-engine.*\.json$")


def engine_runs(raws: list[Path]) -> list[dict[str, Any]]:
    """Every engine run in these folders (each file once: a tarball may hold a copy of a file beside it), in
    the order of their folders: side, where, provenance, step budget and seconds per measure. Repeated and
    alternated runs of one session show their spread, which one file's medians hide."""
    runs: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for raw in raws:
        for name, where, doc in raw_documents(raw):
            match = ENGINE_RUN_FILE.match(name)
            if not match or not isinstance(doc.get("measures"), dict):
                continue
            seconds = {m: e.get("seconds") for m, e in doc["measures"].items() if isinstance(e, dict)}
            key = (match["side"], tuple(sorted(seconds.items())))
            if key in seen or not seconds:
                continue
            seen.add(key)
            settings = doc.get("settings") or {}
            runs.append(
                {
                    "side": match["side"],
                    "source": where,
                    "date": doc.get("date"),
                    "provenance": doc.get("provenance"),
                    "max_num_batched_tokens": settings.get("max_num_batched_tokens"),
                    "seconds": seconds,
                    "prompt_sha256": {m: e.get("prompt_sha256") for m, e in doc["measures"].items()},
                }
            )
    return runs


def _timed_runs(runs: list[dict[str, Any]], name: str, ours_provenance: Any) -> tuple[list[dict], list[dict]]:
    """The ours runs of this code (ours_provenance: a run of other code is another engine) and the vLLM runs that
    timed measure `name`."""
    ours = [r for r in runs if r["side"] == "ours" and r["seconds"].get(name) and r["provenance"] == ours_provenance]
    vllm = [r for r in runs if r["side"] == "vllm" and r["seconds"].get(name)]
    return ours, vllm


def _same_prompts(a: dict[str, Any], b: dict[str, Any], name: str) -> bool:
    """Whether two runs timed `name` on the same token ids (or either predates the digest)."""
    digests = (a["prompt_sha256"].get(name), b["prompt_sha256"].get(name))
    return None in digests or digests[0] == digests[1]


def ratio_spread(runs: list[dict[str, Any]], ours_provenance: Any) -> dict[str, dict[str, Any]]:
    """Per measure, vLLM seconds over ours for every pair of an ours run of this code and a vLLM run that timed
    it with the same prompts: the smallest and largest ratio and how many runs each side had."""
    spread: dict[str, dict[str, Any]] = {}
    for name in MEASURE_NAMES:
        ours, vllm = _timed_runs(runs, name, ours_provenance)
        ratios = [v["seconds"][name] / o["seconds"][name] for o in ours for v in vllm if _same_prompts(o, v, name)]
        if ratios:
            spread[name] = {"min": min(ratios), "max": max(ratios), "ours_runs": len(ours), "vllm_runs": len(vllm)}
    return spread


def median_ratios(runs: list[dict[str, Any]], ours_provenance: Any, target: float = TARGET) -> dict[str, dict]:
    """Per measure, each side's median seconds over its repeated runs of the session (ours: this code's; vLLM's:
    those on ours' token ids) and their ratio, vLLM over ours, against the target: the number a ratio near its
    target is judged by (issue 34: at least 5 runs a side there), where one run's median hides the spread."""
    medians: dict[str, dict[str, Any]] = {}
    for name in MEASURE_NAMES:
        ours, vllm = _timed_runs(runs, name, ours_provenance)
        vllm = [v for v in vllm if any(_same_prompts(o, v, name) for o in ours)]
        if not ours or not vllm:
            continue
        ours_s = statistics.median(r["seconds"][name] for r in ours)
        vllm_s = statistics.median(r["seconds"][name] for r in vllm)
        ratio = vllm_s / ours_s
        medians[name] = {
            "ours_s": ours_s,
            "vllm_s": vllm_s,
            "ratio": ratio,
            "meets_target": ratio >= target,
            "ours_runs": len(ours),
            "vllm_runs": len(vllm),
            "enough_runs": min(len(ours), len(vllm)) >= REPEATS_NEAR_TARGET or abs(ratio - target) > NEAR_TARGET,
        }
    return medians


def step_summary(step: dict[str, Any] | None) -> dict[str, Any] | None:
    """A step's numbers and its verdict under today's bar: the criteria the load generator failed it on, but
    the cache criterion judged against the trace's own reuse (a file of an older flat bar is re-judged);
    `passed_as_recorded` keeps the load generator's verdict of the day."""
    if step is None:
        return None
    summary = {key: step.get(key) for key in (*STEP_KEYS, *STEP_OPTIONAL)}
    failed = [name for name in step.get("failed") or [] if name != "cache_hit"]
    cache_met = report.cache_hit_met(step.get("cache_hit"), step.get("expected_cache_hit"), report.Thresholds())
    if not step.get("unfinished") and not cache_met:
        failed.append("cache_hit")
    summary["passed_as_recorded"] = step.get("passed")
    summary["failed"] = failed
    summary["passed"] = not failed and bool(step.get("requests", 1)) and not step.get("unfinished")
    if step.get("unfinished"):
        summary["unfinished"] = True
    summary["seed"] = step["run"].get("seed")
    return summary


def agent_rows(steps: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    counts = sorted(set(steps["ours"]) | set(steps["vllm"]))
    return [{"agents": n, **{side: step_summary(steps[side].get(n)) for side in SIDES}} for n in counts]


def largest_passing(rows: list[dict[str, Any]], side: str) -> int | None:
    """The side's largest passing count by the load generator's rule (the end of its run of passing steps)."""
    return report.largest_passing(
        [{"agents": row["agents"], "passed": row[side]["passed"]} for row in rows if row[side]]
    )


def passing_ratio(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], float | None, str, str | None]:
    """Each side's largest passing count, kvserve's over vLLM's, what kind of number the ratio is and a note.
    The ratio is None only when a side ran no step. A side's count is exact when it failed a step above it; a
    side that passed its largest step passed at least that many; one that failed its smallest step N passed fewer
    than N (the ratio then uses N). Hence the kind: 'exact'; 'lower_bound' (kvserve's lead is at least this: its
    count can only be higher, or vLLM's only lower); 'upper_bound' (at most this); 'both_below' (neither passed
    its smallest step: no lead shown); 'both_open' (both passed every step they ran: either may be higher)."""
    best = {side: largest_passing(rows, side) for side in SIDES}
    ran = {side: sorted(row["agents"] for row in rows if row[side]) for side in SIDES}
    names = {"ours": "kvserve", "vllm": "vLLM"}
    if not ran["ours"] or not ran["vllm"]:
        parts = [f"{names[side]} ran no step" for side in SIDES if not ran[side]]
        return best, None, None, "no ratio: " + "; ".join(parts)

    def bound(side: str) -> str:
        if best[side] is None:
            return "below"
        return "at_least" if best[side] == ran[side][-1] else "exact"

    ours_bound, vllm_bound = bound("ours"), bound("vllm")
    if ours_bound == vllm_bound == "exact":
        kind = "exact"
    elif ours_bound == vllm_bound == "below":
        kind = "both_below"
    elif ours_bound != "below" and vllm_bound != "at_least":
        kind = "lower_bound"
    elif ours_bound != "at_least" and vllm_bound != "below":
        kind = "upper_bound"
    else:
        kind = "both_open"
    ours = best["ours"] if best["ours"] is not None else ran["ours"][0]
    vllm = best["vllm"] if best["vllm"] is not None else ran["vllm"][0]

    def said(side: str) -> str:
        if best[side] is None:
            return f"{names[side]} failed its smallest step ({ran[side][0]} agents)"
        if bound(side) == "at_least":
            return f"{names[side]} passed every step it ran, up to {best[side]} agents"
        return f"{names[side]} passed up to {best[side]} agents"

    return best, ours / vllm, kind, f"{said('ours')}; {said('vllm')} ({kind.replace('_', ' ')})"


def assemble(raw: Path, commit: str = "", target: float = TARGET) -> dict[str, Any]:
    engines, steps = collect(raw)
    rows = engine_rows(engines, target)
    agents = agent_rows(steps)
    best, ratio, kind, note = passing_ratio(agents)
    ours, vllm = engines.get("ours", {}), engines.get("vllm", {})
    compared = [row for row in rows if row["ratio"] is not None]
    run = next((s["run"] for side in SIDES for s in steps[side].values()), {})
    # agent steps alone carry no engine file: their served model name is the shape they ran
    shape = ours.get("shape") or vllm.get("shape") or run.get("model") or "llama-8b"
    return {
        "date": ours.get("date") or vllm.get("date") or run.get("date"),
        "gpu": ours.get("gpu") or vllm.get("gpu") or _gpu_named(raw),
        "commit": commit or ours.get("commit") or vllm.get("commit"),
        # what each engine file says it ran: commit and the hash of the uncommitted diff (loadgen/provenance.py);
        # a side that ran agent steps only: what its step files say
        "provenance": {
            side: engines[side].get("provenance") if side in engines else step_provenance(steps[side])
            for side in SIDES
            if side in engines or steps[side]
        },
        "engines": {"ours": ours.get("engine", "kvserve"), "vllm": vllm.get("engine")},
        "settings": {
            "shape": f"{shape} config, random weights, bfloat16 (bench/shapes/)",
            "ours": ours.get("settings"),
            "vllm": vllm.get("settings"),
            "vllm_serve_args": vllm_serve_args(raw),
            "agents": run,
            "sources": {side: engines[side]["source"] for side in engines},
        },
        "target": target,
        "engine": rows,
        "engine_meets_target": f"{sum(bool(r['meets_target']) for r in compared)} of {len(compared)}",
        "warm_cold_match": ours.get("warm_cold_match"),
        "warm_cold_match_float32": ours.get("warm_cold_match_float32"),
        "agents": agents,
        "pass_bar": f"the load generator's TTFT, tok/s and error bars; cache hit >= {CACHE_HIT_OF_OPTIMUM} x the "
        "infinite-cache optimum of the same calls",
        "largest_passing": best,
        "largest_passing_ratio": ratio,
        "largest_passing_ratio_kind": kind,
        "largest_passing_note": note,
    }


def with_vllm_variant(result: dict[str, Any], raw: Path) -> dict[str, Any]:
    """vLLM's agent steps under another setting in the same session (raw: that run's files, e.g. with
    `--kv-offloading-size`): its steps, its largest passing count, and ours over the better of vLLM's two."""
    _, steps = collect(raw)
    rows = agent_rows({"ours": {}, "vllm": steps["vllm"]})
    theirs = largest_passing(rows, "vllm")
    best_vllm = max((n for n in (theirs, result["largest_passing"]["vllm"]) if n is not None), default=None)
    mine = result["largest_passing"]["ours"]
    return {
        "agents": [row["vllm"] for row in rows],
        "largest_passing": theirs,
        "largest_passing_best_vllm": best_vllm,
        "largest_passing_ratio_best": mine / best_vllm if mine and best_vllm else None,
    }


def agent_runs(raws: list[Path]) -> dict[str, Any]:
    """Repeated agent steps of one session: each folder is one run (bench/peer_h200.sh under its own PEER_TAG, so
    that the steps run again), its steps judged as in the main table. `runs`: every step of every folder;
    `summary`: per side and agent count the number of runs, how many passed and the spread of per-agent tok/s
    p50 (a verdict near the bar needs several runs before it carries a claim)."""
    runs = []
    for raw in raws:
        _, steps = collect(raw)
        for side in SIDES:
            for agents, step in sorted(steps[side].items()):
                summary = step_summary(step)
                keys = ("tok_s_p50", "tok_s_p10", "ttft_p50", "ttft_p95", "cache_hit", "passed", "failed", "seed")
                runs.append({"side": side, "agents": agents, "where": str(raw), **{k: summary.get(k) for k in keys}})
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["side"], run["agents"]), []).append(run)
    summary = []
    for (side, agents), group in sorted(groups.items()):
        speeds = [run["tok_s_p50"] for run in group if run["tok_s_p50"] is not None]
        summary.append(
            {
                "side": side,
                "agents": agents,
                "runs": len(group),
                "passed": sum(bool(run["passed"]) for run in group),
                "tok_s_p50_median": statistics.median(speeds) if speeds else None,
                "tok_s_p50_min": min(speeds, default=None),
                "tok_s_p50_max": max(speeds, default=None),
            }
        )
    return {"runs": runs, "summary": summary}


def print_agent_runs(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="agent steps over the session's repeated runs: per-agent tok/s p50")
    for column in ("side", "agents", "runs", "passed", "median", "min .. max"):
        t.add_column(column, justify="left" if column == "side" else "right")
    for row in result["agent_runs"]["summary"]:
        t.add_row(
            row["side"],
            str(row["agents"]),
            str(row["runs"]),
            str(row["passed"]),
            _fmt(row["tok_s_p50_median"], ".1f"),
            f"{_fmt(row['tok_s_p50_min'], '.1f')} .. {_fmt(row['tok_s_p50_max'], '.1f')}",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def with_reference(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """vLLM numbers measured elsewhere (not in this device session) beside kvserve's: per engine measure the
    speed ratio against them, per agent count their step, and the cache-aside largest passing counts. Kept
    apart from the same-session fields, which stay as they are (null where vLLM did not run)."""
    seconds = reference.get("engine_seconds", {})
    engine = []
    for row in result["engine"]:
        theirs = seconds.get(row["measure"])
        ours = row.get("ours_s")
        ratio = theirs / ours if theirs and ours else None
        engine.append(
            {
                "measure": row["measure"],
                "ours_s": ours,
                "vllm_reference_s": theirs,
                "ratio": ratio,
                "meets_target": None if ratio is None else ratio >= result["target"],
            }
        )
    ours_best = result["largest_passing"]["ours"]
    # The reference's steps carry no cache hit: one passes when it meets the TTFT and tok/s bars (no errors).
    bar = report.Thresholds()
    passing = [
        step["agents"]
        for step in reference.get("agents", [])
        if step["ttft_p95"] <= bar.ttft_p95_s and step["tok_s_p50"] >= bar.tok_s_p50
        and step["tok_s_p10"] >= bar.tok_s_p10
    ]  # fmt: skip
    theirs_best = max(passing, default=None)
    compared = [row for row in engine if row["ratio"] is not None]
    return {
        "source": reference.get("source"),
        "same_session": bool(reference.get("same_session")),
        "notes": {
            key: reference[key] for key in ("engine_notes", "agents_workload", "cache_hit_note") if key in reference
        },
        "engine": engine,
        "engine_meets_target": f"{sum(bool(r['meets_target']) for r in compared)} of {len(compared)}",
        "agents": reference.get("agents", []),
        "largest_passing": {"ours": ours_best, "vllm_reference": theirs_best},
        "largest_passing_ratio": ours_best / theirs_best if ours_best and theirs_best else None,
        "largest_passing_note": "the reference's largest is the largest step it ran that met the TTFT and tok/s "
        "bars (it has no cache hit), not a search past it",
    }


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def engine_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    title = f"engine level ({result['gpu']}, {result['date']}): ratio = vLLM s / kvserve s, target {result['target']}"
    t = Table(title=title)
    for column in ("measure", "kvserve s", "vLLM s", "ratio", "target", "MFU kvserve / vLLM"):
        t.add_column(column, justify="left" if column == "measure" else "right")
    for row in result["engine"]:
        target = {True: "meets", False: "misses", None: "-"}[row["meets_target"]]
        mfus = f"{_fmt(row['ours_mfu'], '.0%')} / {_fmt(row['vllm_mfu'], '.0%')}" if row["kind"] != "decode" else ""
        t.add_row(
            row["measure"],
            _fmt(row["ours_s"], ".4f"),
            _fmt(row["vllm_s"], ".4f"),
            _fmt(row["ratio"], ".2f"),
            target,
            mfus,
        )
    return t


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    if result["engine"]:
        console.print(engine_table(result))
    t = Table(title="agent level: TTFT p50/p95 s, per-agent tok/s p50/p10, per-request tok/s p10, cache hit")
    for column in ("agents", "kvserve", "verdict", "vLLM", "verdict "):
        t.add_column(column, justify="right" if column == "agents" else "left")

    def cells(step: dict[str, Any] | None) -> tuple[str, str]:
        if step is None:
            return "not run", ""
        text = "  ".join(
            (
                f"{_fmt(step['ttft_p50'], '.2f')}/{_fmt(step['ttft_p95'], '.2f')}",
                f"{_fmt(step['tok_s_p50'], '.1f')}/{_fmt(step['tok_s_p10'], '.1f')}",
                _fmt(step["request_tok_s_p10"], ".1f"),
                _fmt(step["cache_hit"], ".1%"),
            )
        )
        verdict = "PASS" if step["passed"] else "fail: " + ",".join(step["failed"] or [])
        return text, verdict

    for row in result["agents"]:
        t.add_row(str(row["agents"]), *cells(row["ours"]), *cells(row["vllm"]))
    console.print(t)
    console.print(
        f"largest passing: {result['largest_passing']}, ratio {_fmt(result['largest_passing_ratio'], '.2f')} "
        f"({result['largest_passing_note']})"
    )


def print_medians(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"over the session's repeated runs: median seconds, ratio = vLLM / kvserve, target {result['target']}"
    t = Table(title=title)
    for column in ("measure", "kvserve s", "vLLM s", "ratio", "spread", "runs", "target"):
        t.add_column(column, justify="left" if column == "measure" else "right")
    for name, row in result["engine_medians"].items():
        spread = result["engine_ratio_spread"].get(name, {})
        verdict = ("meets" if row["meets_target"] else "misses") + ("" if row["enough_runs"] else " (too few runs)")
        t.add_row(
            name,
            f"{row['ours_s']:.4f}",
            f"{row['vllm_s']:.4f}",
            f"{row['ratio']:.2f}",
            f"{_fmt(spread.get('min'), '.2f')} .. {_fmt(spread.get('max'), '.2f')}",
            f"{row['ours_runs']} x {row['vllm_runs']}",
            verdict,
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", required=True, help="the run folder's raw files (bench/peer_h200.sh's OUT)")
    parser.add_argument("--out", default="", help="default: peer.json in the run folder, beside --raw")
    parser.add_argument("--commit", default="", help="kvserve commit measured (the GPU copy's git HEAD can be stale)")
    parser.add_argument("--no-charts", action="store_true")
    parser.add_argument("--target", type=float, default=TARGET, help="engine ratio each measure must reach")
    parser.add_argument(
        "--vllm-reference",
        default="",
        help="vLLM numbers measured outside this device session (a JSON like "
        "bench/results/2026-12-01-h200-peer-llama-8b/vllm-reference.json), "
        "reported beside ours under vllm_reference when vLLM did not run here",
    )
    parser.add_argument(
        "--vllm-variant-raw",
        default="",
        help="raw files of vLLM's agent steps under another setting in the same session (e.g. its CPU offload, "
        "--kv-offloading-size): reported under vllm_variant, with ours over the better of vLLM's two",
    )
    parser.add_argument("--vllm-variant-name", default="offload", help="what the variant is, for the JSON")
    parser.add_argument(
        "--runs-raw",
        action="append",
        default=[],
        help="folders of more engine runs of the same session (repeats, the other order, other settings): every "
        "run of these and of --raw is listed under engine_runs, with each measure's ratio spread",
    )
    parser.add_argument(
        "--agent-runs-raw",
        action="append",
        default=[],
        help="folders of repeated agent steps of the same session (each a run, e.g. another PEER_TAG): every "
        "step of these and of --raw is listed under agent_runs, with per side and count the runs that passed",
    )
    args = parser.parse_args()
    raw = Path(args.raw)
    if not raw.is_dir():
        parser.error(f"no raw results at {raw}")
    result = assemble(raw, args.commit, args.target)
    if args.vllm_variant_raw:
        variant_raw = Path(args.vllm_variant_raw)
        if not variant_raw.is_dir():
            parser.error(f"no raw results at {variant_raw}")
        result["vllm_variant"] = {"name": args.vllm_variant_name, **with_vllm_variant(result, variant_raw)}
        v = result["vllm_variant"]
        ratio = _fmt(v["largest_passing_ratio_best"], ".2f")
        print(
            f"vLLM {v['name']}: largest passing: {v['largest_passing']}; ours over vLLM's "
            f"best ({v['largest_passing_best_vllm']}): {ratio}"
        )
    if args.runs_raw:
        runs = engine_runs([raw, *map(Path, args.runs_raw)])
        result["engine_runs"] = runs
        code = result["provenance"].get("ours")
        result["engine_ratio_spread"] = ratio_spread(runs, code)
        result["engine_medians"] = median_ratios(runs, code, args.target)
        print_medians(result)
    if args.agent_runs_raw:
        result["agent_runs"] = agent_runs([raw, *map(Path, args.agent_runs_raw)])
        print_agent_runs(result)
    if args.vllm_reference:
        result["vllm_reference"] = with_reference(result, json.loads(Path(args.vllm_reference).read_text()))
        ref = result["vllm_reference"]
        print(
            f"against the vLLM reference (not this session): engine {ref['engine_meets_target']} meet "
            f"{result['target']}; "
            f"largest passing: {ref['largest_passing']}, ratio "
            f"{_fmt(ref['largest_passing_ratio'], '.2f')}"
        )
        for row in ref["engine"]:
            print(
                f"  {row['measure']:<28} ours {_fmt(row['ours_s'], '.4f')}  vLLM {_fmt(row['vllm_reference_s'], '.4f')}"
                f"  ratio {_fmt(row['ratio'], '.2f')}"
            )
    out = Path(args.out) if args.out else raw.parent / "peer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(result)
    print(f"wrote {out}")
    if not args.no_charts:
        try:
            from bench.peer_charts import draw

            print("charts:", ", ".join(str(p) for p in draw(result, out.with_suffix(""))))
        except ImportError as exc:
            print(f"no charts: {exc}")


if __name__ == "__main__":
    main()

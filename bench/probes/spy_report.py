"""Summarise py-spy's collapsed stacks (`py-spy record --format raw --threads`, bench/probes/profile_rank.sh):
per thread its share of all samples, then for each thread the functions with the largest inclusive share
(a function counted once per sample however deep it recurs) and the largest self share (the innermost frame).

    python bench/probes/spy_report.py rank-spy.txt [--top 25] [--thread engine-loop]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

_LOCATION = re.compile(r" \((?P<file>[^()]*?):\d+\)$")


def frame_name(frame: str) -> str:
    """`func (path/file.py:line)` -> `func (file.py)`: lines of one function are one entry."""
    match = _LOCATION.search(frame)
    if match is None:
        return frame
    return f"{frame[: match.start()]} ({Path(match['file']).name})"


def parse(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    """Thread label -> [(frames outermost first, samples)]."""
    threads: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        label = frames[0]
        if len(frames) > 1 and not _LOCATION.search(frames[1]):
            label = f"{label} {frames[1]}"  # py-spy puts the thread's name as the second entry
            frames = frames[1:]
        threads[label].append(([frame_name(f) for f in frames[1:]], int(count)))
    return threads


def report(path: Path, top: int, only: str) -> None:
    threads = parse(path)
    total = sum(n for stacks in threads.values() for _, n in stacks)
    print(f"{path}: {total} samples")
    for label, stacks in sorted(threads.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        samples = sum(n for _, n in stacks)
        print(f"  {samples / total:6.1%}  {label}")
    for label, stacks in threads.items():
        if only and only not in label:
            continue
        samples = sum(n for _, n in stacks)
        if samples < total * 0.02:
            continue
        inclusive: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for frames, n in stacks:
            for name in set(frames):
                inclusive[name] += n
            if frames:
                own[frames[-1]] += n
        print(f"\n{label}: {samples} samples; inclusive")
        for name, n in inclusive.most_common(top):
            print(f"  {n / samples:6.1%}  {name}")
        print("  self")
        for name, n in own.most_common(top // 2):
            print(f"  {n / samples:6.1%}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--thread", default="", help="only threads whose label holds this")
    args = parser.parse_args()
    for path in args.files:
        report(path, args.top, args.thread)


if __name__ == "__main__":
    main()

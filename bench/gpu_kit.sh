#!/usr/bin/env bash
# Fill .whl/ with what our stack needs on the GPU machine and the machine lacks (it cannot reach a package
# registry): wheels for Python 3.12 manylinux x86-64, a redis-server with its libraries, and the Claude Code
# traces. Run here, from the repo root; every GPU call that runs our code names `.whl` in `carry`, and
# bench/stack_lib.sh installs the wheels into /tmp/site and puts .whl/redis-bin on PATH.
#
#     bash bench/gpu_kit.sh            # idempotent: downloads only what is missing, then checks the kit
#
# The pins are the versions of this repo's .venv, where the tests pass. The machine's own packages
# (/work/.library/device/KINDS.md, "Python packages already there") are used for everything else: torch,
# numpy, safetensors, tokenizers, xxhash, jinja2, pyyaml, httpx, anyio, h11, click, rich, prometheus-client.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
KIT=.whl
git check-ignore -q "$KIT/x" || echo "/$KIT/" >> .git/info/exclude

# Missing there, or there in a version we cannot rely on:
#   protobuf, grpcio: protos/*_pb2*.py were generated for protobuf 7.35.1 / grpcio 1.85.1 and refuse an older
#     runtime at import; the machine's versions are not recorded, so ours travel (and shadow them in /tmp/site).
#   typing-extensions: pydantic 2.14 needs a recent one; the machine's version is not recorded.
#   opentelemetry-api: fastapi 0.165 imports it in fastapi.applications (its native telemetry).
#   msgspec, pyzmq: the rank worker and kvstore import contracts/vllm_kv_events.py (vLLM-format KV events).
WHEELS=(
  gguf==0.19.0 tqdm==4.70.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  pydantic-settings==2.16.3 python-dotenv==1.2.4
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 uvicorn==0.54.0
  redis==8.1.0
  grpcio==1.85.3 grpcio-health-checking==1.85.1 protobuf==7.36.2
  msgspec==0.23.0 pyzmq==27.3.0
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p "$KIT"
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}; version=${spec##*==}
  stem=$(echo "$name" | tr '-' '_')
  if ls "$KIT/${stem}-${version}-"*.whl >/dev/null 2>&1; then continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$KIT" "$spec"
done

# One version of each package: two wheels of one name stop the whole install there.
dupes=$(ls "$KIT"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)
[ -z "$dupes" ] || { echo "two versions of: $dupes (remove the stale wheel)"; exit 1; }

# redis-server behind a wrapper: its libraries sit in redis-bin/lib and only the wrapper's exec sees them, so
# the LD_LIBRARY_PATH=.whl/redis-bin that stack_lib.sh exports for every process shadows no system library
# (this machine is Debian 12, glibc 2.36; the GPU image is Ubuntu 24.04, glibc 2.39: the binary runs there).
# glibc and the C++ runtime are left to the system's (newer, backward-compatible) copies.
REDIS=$KIT/redis-bin
rm -rf "$REDIS" && mkdir -p "$REDIS/lib"
cp "$(command -v redis-server)" "$REDIS/lib/redis-server"
ldd "$REDIS/lib/redis-server" | awk '/=> \// {print $3}' | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|ld-linux*|libpthread.so.*|libdl.so.*|librt.so.*) ;;
    *) cp -L "$lib" "$REDIS/lib/" ;;
  esac
done
cat > "$REDIS/redis-server" <<'EOF'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib" exec "$here/lib/redis-server" "$@"
EOF
chmod +x "$REDIS/redis-server"
"$REDIS/redis-server" --version

rm -rf "$KIT/traces" && mkdir -p "$KIT/traces"
cp -r ../shared/traces/claude_code "$KIT/traces/"

# The kit installs as the GPU machine will install it (no index, no deps), and every wheel is for 3.12 x86-64.
rm -rf /tmp/gpu-kit-check
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" --target /tmp/gpu-kit-check "$KIT"/*.whl
for wheel in "$KIT"/*.whl; do
  tags=$(basename "$wheel" .whl | cut -d- -f3-)
  case $tags in
    *none-any|cp312-cp312-*x86_64*|cp39-abi3-*x86_64*|cp310-abi3-*x86_64*|cp311-abi3-*x86_64*|cp312-abi3-*x86_64*) ;;
    *) echo "wheel not for CPython 3.12 x86-64: $wheel"; exit 1 ;;
  esac
done

# Import check under a Python 3.12 (pyenv's, if this machine has one): the kit over the few packages of the GPU
# image that these imports touch; torch and tokenizers are left out, so only the modules that import neither.
# (the first that runs: pyenv's python3.12 shim exists but fails when 3.12 is not the selected version)
if [ -z "${PY312:-}" ]; then
  for candidate in $(command -v python3.12) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    "$candidate" -c pass 2>/dev/null && { PY312=$candidate; break; }
  done
fi
PY312=${PY312:-}
if [ -n "$PY312" ]; then
  [ -x /tmp/gpu-kit-py312/bin/python ] || { "$PY312" -m venv /tmp/gpu-kit-py312 &&
    /tmp/gpu-kit-py312/bin/pip install -q anyio h11 click numpy pyyaml requests httpx xxhash jinja2 prometheus-client rich; }
  PYTHONPATH=/tmp/gpu-kit-check:$PWD /tmp/gpu-kit-py312/bin/python -c '
import importlib, pkgutil, protos
import gguf, launcher.cli, gateway.main, router.main, kvstore.main, loadgen.agents_cli, fastapi.applications
import contracts.vllm_kv_events
for module in pkgutil.iter_modules(protos.__path__):
    importlib.import_module("protos." + module.name)
import fastapi, grpc, google.protobuf, pydantic, sys
print("python", sys.version.split()[0], "imports the kit: fastapi", fastapi.__version__, "pydantic", pydantic.VERSION,
      "grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)'
else
  echo "no python3.12 here: imports not checked (wheel tags only)"
fi
rm -rf /tmp/gpu-kit-check
ls "$KIT"/*.whl | xargs -n1 basename
tree_mb=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
kit_mb=$(du -sb "$KIT" | cut -f1)
echo "kit $((kit_mb / 1048576)) MiB + tracked tree $((tree_mb / 1048576)) MiB" \
  "= $(((kit_mb + tree_mb) / 1048576)) MiB of the 64 MiB a call carries"

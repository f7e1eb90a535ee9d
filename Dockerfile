# syntax=docker/dockerfile:1
# The training image of elastic_ft: torchrun and torchx, the package with its
# dependencies held by constraints.txt, the job specs and the tiny corpus.
# Nothing is downloaded when a container runs (the Hugging Face libraries are
# set offline); base models and data come from the spec's paths.
#
#   docker build -t elastic-ft:cpu .                              # CPU torch
#   docker build --build-arg VARIANT=cuda -t elastic-ft:cuda .    # CUDA torch (GPU nodes)
#
# The container runs as the unprivileged user eft; its entrypoint turns the
# etcd CA passed by AWS Batch into a file (infra/aws/entrypoint.sh).
ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS base-cpu
# torch's CPU build: PyPI's Linux torch is the CUDA one, gigabytes larger.
ENV ELASTIC_FT_TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS base-cuda
# Versions come with the pinned base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# PyPI's torch for Linux x86_64 is the CUDA build and carries its CUDA libraries;
# the host (the ECS GPU AMI) provides the driver.
ENV ELASTIC_FT_TORCH_INDEX=https://pypi.org/simple

# base-${VARIANT} is one of the two stages above, not an image to tag.
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG UID=10001
RUN groupadd --gid "${UID}" eft \
    && useradd --create-home --uid "${UID}" --gid "${UID}" --shell /usr/sbin/nologin eft

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    ELASTIC_FT_ETCD_DIR=/home/eft/.etcd
RUN python3 -m venv /opt/venv

WORKDIR /opt/elastic_ft
COPY constraints.txt pyproject.toml setup.py README.md ./
# torch first, from the variant's index and at the version constraints.txt holds,
# in a layer of its own that a code change does not rebuild.
RUN pip install --index-url "${ELASTIC_FT_TORCH_INDEX}" -c constraints.txt "torch==2.13.*"
COPY elastic_ft ./elastic_ft
RUN pip install -c constraints.txt ".[qlora]" \
    && python -c "import elastic_ft.components, torch, torchx; print('torch', torch.__version__)"

COPY specs ./specs
COPY data ./data
COPY --chmod=0755 infra/aws/entrypoint.sh /usr/local/bin/elastic-ft-entrypoint
# The default job writes its checkpoints and logs under runs/ (the component's file://./runs).
RUN install -d -o eft -g eft /opt/elastic_ft/runs

# Numeric, so that a runtime refusing root (runAsNonRoot) can check it without /etc/passwd.
USER ${UID}:${UID}
ENTRYPOINT ["/usr/local/bin/elastic-ft-entrypoint"]
CMD ["torchx", "run", "-s", "local_cwd", "elastic_ft.train"]

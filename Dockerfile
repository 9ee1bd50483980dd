# hvd_syncbn image: CPU by default; GPU (CUDA, NCCL) with
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-cudnn-devel-ubuntu22.04 \
#                --build-arg TF_PACKAGE=tensorflow --build-arg HOROVOD_GPU_OPERATIONS=NCCL .
# It runs the same set-up step as the tests (launch/install.sh), then checks the build.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TF_PACKAGE=tensorflow-cpu
ARG TF_VERSION=2.21.*
ARG HOROVOD_VERSION=0.28.1
ARG HOROVOD_GPU_OPERATIONS=
ENV TORCH_VERSION=${TORCH_VERSION} TF_PACKAGE=${TF_PACKAGE} TF_VERSION=${TF_VERSION} \
    HOROVOD_VERSION=${HOROVOD_VERSION} HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS} \
    HVD_SYNCBN_VENV=/opt/hvd_syncbn/.venv HVD_SYNCBN_CACHE=/tmp/hvd_syncbn-cache \
    DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/hvd_syncbn
COPY . /opt/hvd_syncbn
RUN bash launch/install.sh && rm -rf /tmp/hvd_syncbn-cache /root/.cache/pip \
    && "${HVD_SYNCBN_VENV}/bin/python" -c "import hvd_syncbn.torch, hvd_syncbn.tensorflow"

RUN useradd --create-home --uid 1000 --shell /bin/bash app && chown -R app /opt/hvd_syncbn
USER 1000
ENV PATH=/opt/hvd_syncbn/.venv/bin:${PATH} OMP_NUM_THREADS=1
CMD ["horovodrun", "--check-build"]

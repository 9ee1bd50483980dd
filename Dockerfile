# hvd_syncbn image: CPU by default; GPU (CUDA, NCCL) with
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-cudnn-devel-ubuntu22.04 \
#                --build-arg TF_PACKAGE=tensorflow --build-arg HOROVOD_GPU_OPERATIONS=NCCL .
# It runs the same set-up step as the tests (launch/install.sh), then checks the build.
# The base is python:3.11-slim or a bare Debian bookworm (launch/image.sh builds FROM one
# made by debootstrap; install.sh then installs python3).
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
# One layer, so what only the build needs stays out of the image: install.sh removes the
# compilers and headers it installed; the wheel cache goes unless it is a mount
# (launch/image.sh mounts the host's there).
RUN HVD_SYNCBN_DROP_BUILD_DEPS=1 bash launch/install.sh \
    && "${HVD_SYNCBN_VENV}/bin/python" -c "import hvd_syncbn.torch, hvd_syncbn.tensorflow" \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /root/.cache/pip \
    && { mountpoint -q "${HVD_SYNCBN_CACHE}" || rm -rf "${HVD_SYNCBN_CACHE}"; }

RUN useradd --create-home --uid 1000 --shell /bin/bash app && chown -R app /opt/hvd_syncbn
USER 1000
# One thread per rank, and Horovod's recommended mpirun flags as Open MPI's environment
# parameters: -bind-to none -map-by slot -mca pml ob1 -mca btl ^openib, plus
# -mca mpi_yield_when_idle 1 (launch/README.md says why), for any mpirun in the image;
# and mpirun.sh's out-of-band keepalive for the default HVD_SYNCBN_TIMEOUT (60 s): a lost
# node ends the job within 5 + 20 x 6 = 125 s (launch/mpirun.sh's own, from the timeout, wins).
ENV PATH=/opt/hvd_syncbn/.venv/bin:${PATH} OMP_NUM_THREADS=1 \
    OMPI_MCA_hwloc_base_binding_policy=none OMPI_MCA_rmaps_base_mapping_policy=slot \
    OMPI_MCA_pml=ob1 OMPI_MCA_btl=^openib OMPI_MCA_mpi_yield_when_idle=1 \
    OMPI_MCA_oob_tcp_keepalive_time=5 OMPI_MCA_oob_tcp_keepalive_intvl=20 OMPI_MCA_oob_tcp_keepalive_probes=6
CMD ["horovodrun", "--check-build"]

# The container image of a jaxrlhf run (launch/gcp_batch.py --image=...):
# this repository installed with the JAX wheels of one accelerator.
#
#   docker build --build-arg JAX_EXTRA=cuda13 -t IMAGE .   # NVIDIA GPUs (default)
#   docker build --build-arg JAX_EXTRA=cpu -t IMAGE .      # CPU only
#   docker build --build-arg JAX_EXTRA=tpu -t IMAGE .      # TPU VMs
#
# JAX_EXTRA is an extra of the jax package; pip picks the jax version that
# setup.cfg allows, and the extra pins its jaxlib, CUDA plugin or libtpu to
# it. `docker run IMAGE --config=configs/quickstart.py --workdir=...` runs
# python -m jaxrlhf.main (Batch jobs name that command themselves).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim
ARG JAX_EXTRA=cuda13
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/jaxrlhf
# bubblewrap: the stronger isolation of model-written code (the code reward,
# the Python tool of agents) where the container may create namespaces.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
# The package's metadata first: the dependencies' layer is rebuilt only when
# they change.
COPY setup.cfg pyproject.toml README.md ./
COPY jaxrlhf/__init__.py jaxrlhf/
RUN pip install . "jax[${JAX_EXTRA}]"
COPY jaxrlhf/ jaxrlhf/
COPY configs/ configs/
RUN pip install --no-deps . && python -c "import jaxrlhf.main"
ENTRYPOINT ["python", "-m", "jaxrlhf.main"]

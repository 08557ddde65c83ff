"""Imported when the Python of a fake TPU worker starts (fake_cloud/uv.py
installs it in the workers' venv): JAX there detects its slice as on a TPU
pod, from the workers' environment (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES,
as fake_cloud/gcloud.py's ssh sets them) in place of a TPU VM's metadata
server, which does not exist here."""

import os

if os.environ.get("TPU_WORKER_HOSTNAMES"):
  # pylint: disable=g-import-not-at-top
  from jax._src.clusters import cloud_tpu_cluster
  from jax._src.clusters import cluster

  # What libtpu finding TPU chips sets: the process is on a TPU VM.
  cloud_tpu_cluster.running_in_cloud_tpu_vm = True
  cluster.running_in_cloud_tpu_vm = True
  # No metadata server: the slice is the one the environment describes.
  cloud_tpu_cluster.GceTpuCluster.is_env_present = classmethod(
      lambda cls: False)
  cloud_tpu_cluster.get_tpu_env_value_from_metadata = lambda key: None

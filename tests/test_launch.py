"""The GCP Batch launcher writes a job that runs our command."""

import json
import shlex
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "launch"))
import gcp_batch  # noqa: E402


def test_batch_job_spec_runs_main_with_overrides(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  gcp_batch.main(["--name=run1", "--config=configs/quickstart.py",
                  "--workdir=gs://b/run1", "--image=img", "--gpu_count=4",
                  "--spot", "--", "--config.train.num_steps=7"])
  spec = json.load(open(tmp_path / "run1.batch.json"))
  task = spec["taskGroups"][0]["taskSpec"]
  command = shlex.split(task["runnables"][0]["container"]["commands"][2])
  assert command == ["python", "-m", "jaxrlhf.main",
                     "--config=configs/quickstart.py", "--workdir=gs://b/run1",
                     "--config.train.num_steps=7"]
  policy = spec["allocationPolicy"]["instances"][0]["policy"]
  assert policy["accelerators"][0]["count"] == 4
  assert policy["provisioningModel"] == "SPOT"
  assert task["maxRetryCount"] == 3

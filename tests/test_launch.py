"""The GCP Batch launcher and the image it runs (the TPU pod, Slurm and
local launchers: test_launch_clusters.py)."""

import json
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, quiet_env
import fake_cloud

sys.path.insert(0, str(REPO / "launch"))
import gcp_batch  # noqa: E402

GOOD = ["--name=dro-t5l", "--config=configs/quickstart.py",
        "--workdir=gs://bucket/dro-t5l", "--image=img"]


def test_batch_job_runs_main_in_the_image_and_retries_only_preemptions(
    tmp_path):
  """README's command, run from the repository's top and submitted through
  the fake gcloud, which runs the job's container command here as Batch
  would (FAKE_BATCH_RUN), with the image's `python` this one, whatever
  `python` is first on PATH (another Python, when a venv's tests run
  without activating it)."""
  cloud = tmp_path / "cloud"
  other = tmp_path / "other-python"
  other.mkdir()
  (other / "python").write_text("#!/bin/sh\necho 'not this Python'\n"
                                "exit 1\n")
  (other / "python").chmod(0o755)
  env = fake_cloud.install(cloud, quiet_env(
      FAKE_BATCH_RUN="1", FAKE_CONTAINER_DIR=str(REPO),
      TMPDIR=str(tmp_path), PATH=f"{other}:{quiet_env()['PATH']}"))
  done = subprocess.run(
      [sys.executable, str(REPO / "launch" / "gcp_batch.py"), *GOOD,
       "--gpu_count=4", "--spot", "--submit", "--",
       "--config.mesh.shape=(-1,4)", "--config.train.num_steps=0"],
      cwd=REPO, env=env, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  assert done.stderr == ""
  # The spec went to a new directory in TMPDIR, nothing into the repository
  # (whose files launch/tpu_vm_pod.sh run copies to TPU workers).
  wrote = pathlib.Path(done.stdout.splitlines()[0].removeprefix("Wrote "))
  assert wrote.name == "dro-t5l.batch.json"
  assert wrote.parent.parent == tmp_path
  assert not (REPO / "dro-t5l.batch.json").exists()
  spec = json.loads(wrote.read_text())
  task = spec["taskGroups"][0]["taskSpec"]
  container = task["runnables"][0]["container"]
  # Our command whatever the image's entrypoint, with no shell in between.
  assert [container["entrypoint"], *container["commands"]] == [
      "python", "-m", "jaxrlhf.main", "--config=configs/quickstart.py",
      "--workdir=gs://bucket/dro-t5l", "--config.mesh.shape=(-1,4)",
      "--config.train.num_steps=0"]
  assert task["maxRetryCount"] == 3
  assert task["lifecyclePolicies"] == [
      {"action": "RETRY_TASK", "actionCondition": {"exitCodes": [50001]}}]
  policy = spec["allocationPolicy"]["instances"][0]["policy"]
  assert policy["accelerators"] == [{"type": "nvidia-h100-80gb", "count": 4}]
  assert policy["provisioningModel"] == "SPOT"
  # The run refused its config (exit 2) once; Batch did not retry it.
  ran = json.loads((cloud / "batch-dro-t5l.json").read_text())
  assert ran["attempts"] == [2]
  assert (cloud / "batch-dro-t5l.log").read_text() == (
      "error: config.train.num_steps: 0 must be > 0.\n")
  # What was submitted, and how to follow it.
  (submit,) = fake_cloud.calls(cloud, "gcloud")
  assert submit["argv"][:4] == ["batch", "jobs", "submit", "dro-t5l"]
  lines = done.stdout.splitlines()
  assert lines[1] == "Submitted job dro-t5l (uid dro-t5l-0a1b2c3d-0000)."
  assert lines[2] == (
      "  console: https://console.cloud.google.com/batch/jobsDetail/regions/"
      "us-central1/jobs/dro-t5l/details?project=fake-project")
  assert "gcloud batch jobs describe dro-t5l --location=us-central1" in lines[3]
  assert 'labels.job_uid="dro-t5l-0a1b2c3d-0000"' in lines[4]


@pytest.mark.parametrize("args, message", [
    (["--name=dro_t5l"], "error: --name=dro_t5l: Batch job names are 1-63 "
     "lowercase letters"),
    (["--workdir=/tmp/run"], "error: --workdir=/tmp/run: must be a gs:// "
     "path"),
    # What an unset variable leaves: gs://$BUCKET/dro, gs://b/$RUN/x.
    (["--workdir=gs:///dro"], "error: --workdir=gs:///dro: the bucket name "
     "is empty (an unset variable?); give gs://BUCKET/PATH."),
    (["--workdir=gs://bucket//x"], "error: --workdir=gs://bucket//x: it has "
     "an empty part ('//'; an unset variable?)"),
    (["--workdir=gs://My_Bucket/x"], "error: --workdir=gs://My_Bucket/x: "
     "'My_Bucket' is not a bucket name"),
    ([f"--spec_out={REPO}/dro.json"], f"error: --spec_out={REPO}/dro.json: "
     "inside the repository"),
    (["--config=configs/nope.py"], "error: --config=configs/nope.py: no such "
     "file in this repository"),
    (["--max_retry_count=11"], "error: --max_retry_count=11: Batch allows 0 "
     "to 10."),
    (["--gpu_count=two"], "error: argument --gpu_count: invalid int value"),
])
def test_batch_refuses_bad_commands_before_writing(tmp_path, monkeypatch,
                                                   capsys, args, message):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  with pytest.raises(SystemExit) as exit_:
    gcp_batch.main(GOOD + args)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(message) and err.count("\n") == 1, err
  assert not list(tmp_path.iterdir())
  assert not (REPO / "dro.json").exists()


def test_batch_submit_failures_are_one_line(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("PATH", str(tmp_path))  # no gcloud
  spec = tmp_path / "specs" / "dro.json"
  with pytest.raises(SystemExit) as exit_:
    gcp_batch.main(GOOD + ["--submit", f"--spec_out={spec}"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err == (
      "error: gcloud is not on PATH: install the Google Cloud CLI, or submit "
      f"{spec} another way.\n")
  assert json.loads(spec.read_text())["taskGroups"]
  env = fake_cloud.install(tmp_path / "cloud", {"PATH": "/usr/bin:/bin"})
  monkeypatch.setenv("PATH", env["PATH"])
  monkeypatch.setenv("FAKE_CLOUD", env["FAKE_CLOUD"])
  monkeypatch.setenv("FAKE_BATCH_FAIL", "PERMISSION_DENIED: Permission "
                     "'batch.jobs.create' denied\non 'projects/p'")
  with pytest.raises(SystemExit) as exit_:
    gcp_batch.main(GOOD + ["--submit", f"--spec_out={spec}"])
  assert exit_.value.code == 1
  assert capsys.readouterr().err == (
      "error: gcloud batch jobs submit failed: ERROR: (gcloud.batch.jobs."
      "submit) PERMISSION_DENIED: Permission 'batch.jobs.create' denied on "
      "'projects/p'\n")


def test_dockerfile_installs_the_package_with_a_jax_extra():
  """The image recipe copies what exists and .dockerignore lets through,
  and installs the package with an extra that jax has."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  dockerfile = (REPO / "Dockerfile").read_text()
  ignore = [l for l in (REPO / ".dockerignore").read_text().splitlines()
            if l and not l.startswith("#")]
  assert ignore[0] == "*"  # everything else is let through by name
  allowed = {l[1:].rstrip("/") for l in ignore if l.startswith("!")}
  for line in re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE):
    for source in line.split():
      path = pathlib.Path(source.rstrip("/"))
      assert (REPO / path).exists(), source
      assert path.parts[0] in allowed, source
  extras = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
  documented = set(re.findall(r"--build-arg JAX_EXTRA=(\w+)", dockerfile))
  (default,) = re.findall(r"^ARG JAX_EXTRA=(\w+)$", dockerfile, re.MULTILINE)
  assert documented == {"cuda13", "cpu", "tpu"} and documented <= extras
  assert default in documented
  assert 'pip install . "jax[${JAX_EXTRA}]"' in dockerfile
  assert 'ENTRYPOINT ["python", "-m", "jaxrlhf.main"]' in dockerfile


def test_an_unreachable_gs_workdir_is_named_in_one_line(monkeypatch):
  """TensorFlow's message for a gs:// path it cannot reach holds a newline;
  the run's error is still one line."""
  from jaxrlhf.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

  class Unreachable:
    def __init__(self, path):
      del path

    def __truediv__(self, name):
      return self

    def mkdir(self, **kwargs):
      raise OSError("Error executing an HTTP request: libcurl code 6 meaning "
                    "'Could not resolve hostname'\n\t when reading metadata "
                    "of gs://b/run")
  monkeypatch.setattr(workdir_lib.epath, "Path", Unreachable)
  with pytest.raises(workdir_lib.WorkdirError) as error:
    workdir_lib.check_workdir("gs://b/run")
  assert str(error.value) == (
      "--workdir 'gs://b/run' is not a writable directory (Error executing "
      "an HTTP request: libcurl code 6 meaning 'Could not resolve hostname' "
      "when reading metadata of gs://b/run); choose a path you can write to.")

"""Faults a run must survive: each ends in a run bit-identical to one that was
never disturbed, or in one line naming what to fix, with nothing left behind.

One tiny SFT run of 4 steps (checkpoints at steps 2 and 4, a constant
evaluation so that evaluation rows are in metrics.jsonl) is the uninterrupted
reference; each fault test disturbs a copy of its workdir and runs again.
Multi-process faults are in tests/test_distributed.py.
"""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, cli_args, evaluated_by, quiet_env, tiny_config
from jaxrlhf import algorithms
from jaxrlhf import checkpoint_files
from jaxrlhf import config_schema
from jaxrlhf import defaults
from jaxrlhf.train import checkpointing
from jaxrlhf.train import loop
from jaxrlhf.train import metrics as metrics_lib
from jaxrlhf.train import workdir as workdir_lib

STEPS = 4


def _constant_evaluation(trainer, state):
  del trainer, state
  return {"eval/score": 1.0}


@pytest.fixture(scope="module", autouse=True)
def cheap_evaluation():
  """SFT with a constant evaluation: the faults are about the loop, and
  the quickstart's greedy decoding would cost more than the training."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(algorithms.REGISTRY, "sft", evaluated_by(
        algorithms.get("sft"), _constant_evaluation))
    yield


def _config(**overrides):
  settings = dict(train__num_steps=STEPS, checkpoint__every_steps=2,
                  checkpoint__keep=3)
  settings.update(overrides)
  return tiny_config(**settings)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cheap_evaluation):
  """The uninterrupted run's workdir (checkpoints 2 and 4)."""
  del cheap_evaluation
  path = tmp_path_factory.mktemp("reference")
  loop.train(_config(), str(path))
  return path


def _copy(reference_dir, tmp_path, name="run"):
  target = tmp_path / name
  shutil.copytree(reference_dir, target)
  return target


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _params(workdir, step):
  state = checkpoint_files.restore_state_as_numpy(
      os.path.join(workdir, "checkpoints", str(step), "state"))
  return state["params"]["policy"], state["opt_state"]


def _steps(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir,
                                                        "checkpoints"))
                if d.isdigit())


def _assert_same_run(workdir, reference_dir):
  """Bit-identical to the reference: every metrics row, and the final
  parameters and optimizer state."""
  assert _rows(workdir) == _rows(reference_dir)
  jax.tree.map(np.testing.assert_array_equal, _params(workdir, STEPS),
               _params(reference_dir, STEPS))


def _leftovers(workdir):
  """Temporary files of ours or orbax's anywhere in the workdir."""
  found = []
  for folder, dirs, names in os.walk(workdir):
    found += [os.path.join(folder, n) for n in dirs + names
              if ".tmp" in n or "orbax-checkpoint-tmp" in n]
  return found


# --- 1. damaged checkpoints --------------------------------------------------


def _state_file(step_dir):
  """The largest array data file of the state item."""
  files = [os.path.join(folder, n)
           for folder, _, names in os.walk(step_dir / "state") for n in names]
  return max(files, key=os.path.getsize)


def _data_file(step_dir):
  return str(step_dir / "data" / "metadata")


def _flip(path):
  data = bytearray(open(path, "rb").read())
  # The data position's file is {"position": 64}: flip the low bit of its
  # last digit, which still reads as a (wrong) position.
  digits = [i for i, b in enumerate(data) if chr(b).isdigit()]
  i = digits[-1] if path.endswith("metadata") else len(data) // 2
  data[i] ^= 0x01
  open(path, "wb").write(bytes(data))


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


DAMAGES = {"flip": _flip, "truncate": _truncate, "delete": os.remove}
PROBLEMS = {"flip": "does not have the contents it was saved with",
            "truncate": "when saved (truncated or overwritten)",
            "delete": "is missing"}


@pytest.mark.parametrize("item", ["state", "data"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_checkpoint_is_named_moved_aside_and_the_run_ends_identical(
    reference, tmp_path, capsys, item, damage):
  run = _copy(reference, tmp_path)
  step_dir = run / "checkpoints" / str(STEPS)
  path = _state_file(step_dir) if item == "state" else _data_file(step_dir)
  name = os.path.relpath(path, step_dir)
  DAMAGES[damage](path)
  capsys.readouterr()
  loop.train(_config(), str(run))
  out = capsys.readouterr().out
  line = next(l for l in out.splitlines() if "cannot be used" in l)
  assert line.startswith(f"Checkpoint step {STEPS} in ")
  assert f"cannot be used: file {name} " in line and PROBLEMS[damage] in line
  assert "resuming from step 2" in line
  assert "Resumed from checkpoint at step 2" in out
  # Moved aside, never deleted: the damaged step is kept as it was found.
  aside = run / "damaged_checkpoints" / str(STEPS)
  assert (aside / checkpointing.MANIFEST).exists()
  assert os.path.exists(aside / name) == (damage != "delete")
  _assert_same_run(run, reference)
  assert _steps(run) == [2, STEPS]
  assert not _leftovers(run)


def test_a_step_whose_save_did_not_finish_is_moved_aside(reference, tmp_path):
  run = _copy(reference, tmp_path)
  step_dir = run / "checkpoints" / str(STEPS)
  # Killed between orbax's commit and the manifest.
  os.remove(step_dir / checkpointing.MANIFEST)
  assert "its save did not finish" in checkpointing.verify(step_dir)
  assert checkpointing.verify(run / "checkpoints" / "2") is None


def test_no_checkpoint_that_verifies_refuses_in_one_line(reference, tmp_path):
  run = _copy(reference, tmp_path)
  for step in (2, STEPS):
    _flip(_state_file(run / "checkpoints" / str(step)))
  config_before = (run / "config.json").read_text()
  with pytest.raises(checkpointing.CheckpointError) as error:
    loop.train(_config(), str(run))
  message = str(error.value)
  assert "\n" not in message
  assert "No checkpoint in" in message and "step 2: file state/" in message
  assert f"step {STEPS}: file state/" in message
  # Nothing moved, nothing rewritten.
  assert _steps(run) == [2, STEPS] and not (run / "damaged_checkpoints").exists()
  assert (run / "config.json").read_text() == config_before


# --- 2. the workdir lock -----------------------------------------------------


def _write_lock(workdir, **record):
  os.makedirs(workdir, exist_ok=True)
  (workdir / workdir_lib.LOCK).write_text(json.dumps(record))


def test_a_live_run_holding_the_workdir_refuses_a_second_in_one_line(
    reference, tmp_path):
  run = _copy(reference, tmp_path)
  holder = subprocess.Popen([sys.executable, "-c",
                             "import time; time.sleep(600)"])
  try:
    _write_lock(run, host=socket.gethostname(), pid=holder.pid,
                process_start=workdir_lib._process_start(holder.pid),
                started="2026-01-01T00:00:00+00:00", refreshed=0)
    before = {p: (run / p).read_text() for p in ("config.json",
                                                  "metrics.jsonl")}
    with pytest.raises(loop.WorkdirError) as error:
      loop.train(_config(optimizer__learning_rate=3e-3), str(run))
    message = str(error.value)
    assert "\n" not in message
    assert (f"is in use by another run (process {holder.pid} on host "
            f"'{socket.gethostname()}', started 2026-01-01") in message
    # The second run wrote nothing: the workdir is the first run's.
    assert {p: (run / p).read_text() for p in before} == before
    assert _steps(run) == [2, STEPS] and not _leftovers(run)
  finally:
    holder.kill()
    holder.wait()


def test_a_dead_runs_lock_is_taken_over_and_a_resume_may_extend_the_run(
    reference, tmp_path, capsys):
  run = _copy(reference, tmp_path)
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()  # a PID that no longer runs (a kill -9 left its lock)
  _write_lock(run, host=socket.gethostname(), pid=gone.pid,
              process_start="1", started="2026-01-01T00:00:00+00:00",
              refreshed=0)
  capsys.readouterr()
  loop.train(_config(train__num_steps=STEPS + 1), str(run))
  out = capsys.readouterr().out
  assert (f"Taking over the lock of {run} from process {gone.pid} on host "
          f"'{socket.gethostname()}'") in out
  assert "that process no longer exists" in out
  assert not (run / workdir_lib.LOCK).exists()  # released at the end
  # A resumable field changed: said in a line, the old config kept.
  assert (f"Resuming at step {STEPS} with config.train.num_steps {STEPS} -> "
          f"{STEPS + 1}") in out
  kept = json.loads((run / f"config.before_step_{STEPS}.json").read_text())
  assert kept["train"]["num_steps"] == STEPS
  assert json.loads((run / "config.json").read_text())["train"][
      "num_steps"] == STEPS + 1
  assert _steps(run)[-1] == STEPS + 1


# A new value of every field declared resumable; a field declared resumable
# later must be added here, so that a real resume tests it too.
_RULES = tuple((name, "tensor" if axis == "model" else axis)
               for name, axis in defaults.base_config().sharding
               .logical_axis_rules)
RESUMABLE_CHANGES = {
    "model.remat_policy": "full", "model.attention_impl": "dot_product",
    "train.log_every": 2,
    "train.lost_process_timeout_s": 90, "optimizer.learning_rate": 5e-3,
    # (wandb's package is in the test extra; 'disabled' logs nothing.)
    "train.wandb": True, "train.wandb_mode": "disabled",
    "train.wandb_project": "other", "train.wandb_entity": "someone",
    "optimizer.grad_clip_norm": 0.0, "checkpoint.every_steps": 1,
    "checkpoint.keep": 2, "eval.every_steps": 1, "eval.batch_size": 8,
    "eval.with_rewards": "off", "eval.samples_per_prompt": 2,
    "eval.pass_k": "2", "eval.pass_threshold": 0.5,
    "mesh.shape": (1, -1), "mesh.axis_names": ("data", "tensor"),
    "sharding.logical_axis_rules": _RULES, "pipeline.stages": "sft",
    "pipeline.num_prompts": 10, "pipeline.num_eval_prompts": 10,
    "pipeline.samples_per_prompt": 2, "pipeline.sampling_temperature": 0.5,
    "pipeline.annotator_beta": 1.0, "pipeline.reward_model_steps": 10,
    "pipeline.reward_model_learning_rate": 0.1, "pipeline.policy_steps": 10,
    "pipeline.policy_learning_rate": 0.1,
    "pipeline.eval_samples_per_prompt": 1, "pipeline.online_steps": 10,
    "pipeline.online_learning_rate": 0.1, "pipeline.best_of_n": 2,
}


def test_every_field_declared_resumable_changes_on_a_real_resume(
    reference, tmp_path, capsys):
  """Each resumable field changed at once (gradient clipping turned off),
  then clipping turned back on: both resumes go on from the checkpoint,
  each naming its changes; README names every resumable field."""
  declared = set(config_schema.resumable_paths(defaults.groups()))
  # (eval.only evaluates instead of training on: tests/test_held_out_eval.py
  # changes it on a trained workdir.)
  assert declared == set(RESUMABLE_CHANGES) | {"train.num_steps",
                                                "eval.only"}
  readme = (REPO / "README.md").read_text()
  for field in declared:
    group = field.split(".")[0]
    assert f"`{field}`" in readme or f"`{group}.*`" in readme, field
  run = _copy(reference, tmp_path)
  overrides = {k.replace(".", "__"): v for k, v in RESUMABLE_CHANGES.items()}
  capsys.readouterr()
  loop.train(_config(train__num_steps=STEPS + 1, **overrides), str(run))
  out = capsys.readouterr().out
  assert f"Resuming at step {STEPS} with" in out
  for field in declared - {"eval.only"}:
    assert f"config.{field} " in out, field
  overrides["optimizer__grad_clip_norm"] = 1.0
  loop.train(_config(train__num_steps=STEPS + 2, **overrides), str(run))
  out = capsys.readouterr().out
  assert f"Resuming at step {STEPS + 1} with" in out
  assert "config.optimizer.grad_clip_norm 0.0 -> 1.0;" in out
  assert _steps(run)[-1] == STEPS + 2


def test_a_lock_from_another_host_is_stale_only_when_not_refreshed(tmp_path):
  import time  # pylint: disable=g-import-not-at-top
  other = dict(host="another-host", pid=1, process_start=None,
               started="2026-01-01T00:00:00+00:00")
  _write_lock(tmp_path, refreshed=time.time(), **other)
  with pytest.raises(loop.WorkdirError, match="on host 'another-host'"):
    workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  _write_lock(tmp_path, refreshed=time.time() - workdir_lib.STALE_AFTER_S - 60,
              **other)
  lock = workdir_lib.WorkdirLock(str(tmp_path))
  lock.acquire()
  held = json.loads((tmp_path / workdir_lib.LOCK).read_text())
  assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
  lock.release()
  assert not (tmp_path / workdir_lib.LOCK).exists()


# --- 3. a full disk ----------------------------------------------------------


def _no_space(*args, **kwargs):
  del args, kwargs
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_orbax_save(monkeypatch, at_step):
  """Orbax's own write of the data item fails for a full disk, half-way
  through the file, while it saves `at_step` (in orbax's commit thread)."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler  # pylint: disable=g-import-not-at-top
  real = handler.JsonCheckpointHandler._save_fn

  async def save_fn(self, item, directory):
    if int(item["position"]) == at_step:  # the position counts batches
      (directory / "metadata").write_text('{"posi')
      _no_space()
    return await real(self, item, directory)

  monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", save_fn)


def _fail_metrics_row(monkeypatch, at_step):
  """The metrics.jsonl row of `at_step` is half written when the disk
  fills up."""
  real_open = open

  class Filling:

    def __init__(self, f):
      self._f = f

    def write(self, text):
      if json.loads(text)["step"] == at_step:
        self._f.write(text[:len(text) // 2])
        self._f.flush()
        _no_space()
      return self._f.write(text)

    def __getattr__(self, name):
      return getattr(self._f, name)

  def fake_open(path, mode="r", *args, **kwargs):
    f = real_open(path, mode, *args, **kwargs)
    return Filling(f) if str(path).endswith("metrics.jsonl") and "a" in mode else f

  monkeypatch.setattr(metrics_lib, "open", fake_open, raising=False)


def _fail_config_json(monkeypatch):
  """config.json's temporary file is half written when the disk fills."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  cls = type(epath.Path("/"))
  real = cls.write_text

  def write_text(self, text, *args, **kwargs):
    if self.name == "config.json.tmp":
      real(self, text[:10])
      _no_space()
    return real(self, text, *args, **kwargs)

  monkeypatch.setattr(cls, "write_text", write_text)


@pytest.mark.parametrize("what,start_from", [
    ("first checkpoint", None), ("checkpoint", 2), ("metrics row", 2),
    ("config.json", 2)])
def test_a_full_disk_stops_in_one_line_leaves_nothing_and_resumes_exactly(
    reference, tmp_path, monkeypatch, what, start_from):
  if start_from is None:
    run = tmp_path / "run"
  else:
    run = _copy(reference, tmp_path)
    shutil.rmtree(run / "checkpoints" / str(STEPS))  # as if it stopped at 2
  kept = {p: (run / "checkpoints" / str(p) / checkpointing.MANIFEST
              ).read_text() for p in (_steps(run) if run.exists() else [])}
  config_before = (run / "config.json").read_text() if run.exists() else None
  with monkeypatch.context() as fault:
    if what == "first checkpoint":
      _fail_orbax_save(fault, at_step=2)
      where = "the checkpoint of step 2 in "
    elif what == "checkpoint":
      _fail_orbax_save(fault, at_step=STEPS)
      where = f"the checkpoint of step {STEPS} in "
    elif what == "metrics row":
      _fail_metrics_row(fault, at_step=3)
      where = "metrics.jsonl in "
    else:
      _fail_config_json(fault)
      where = "config.json: "
    with pytest.raises(loop.WriteError) as error:
      loop.train(_config(), str(run))
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith("Could not write ") and where in message
  assert "the disk is full (no space left on device)" in message
  assert "run the same command again" in message
  assert not _leftovers(run)
  # The previous checkpoints are as they were; every metrics row is whole.
  assert {p: (run / "checkpoints" / str(p) / checkpointing.MANIFEST
              ).read_text() for p in kept} == kept
  assert set(_steps(run)) == set(kept)
  _rows(run)
  if what == "config.json":
    assert (run / "config.json").read_text() == config_before
  # Space is freed: the same command resumes and ends as if nothing happened.
  loop.train(_config(), str(run))
  _assert_same_run(run, reference)


def test_a_full_disk_on_the_command_line_is_one_line_and_exit_status_1(
    tmp_path):
  """No traceback (nor a second one from orbax's threads at exit). And the
  command line, which pauses the garbage collector while its modules load,
  ran with it on (the imports' objects frozen out of its passes)."""
  script = (
      "import atexit, errno, gc, os, sys\n"
      "atexit.register(lambda: print('collector:', gc.isenabled(),\n"
      "                              gc.get_freeze_count() > 0))\n"
      "from orbax.checkpoint._src.handlers import json_checkpoint_handler as h\n"
      "async def full(self, item, directory):\n"
      "  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
      "h.JsonCheckpointHandler._save_fn = full\n"
      "from jaxrlhf import main\n"
      "sys.argv = sys.argv[1:]\n"
      "main.run()\n")
  args = [sys.executable, "-c", script, "jaxrlhf.main",
          f"--config={REPO / 'configs' / 'quickstart.py'}",
          f"--workdir={tmp_path / 'run'}",
          *[f"--config.{k.replace('__', '.')}={v}" for k, v in {
              "train__num_steps": 1, "eval__num_examples": 16,
              "eval__batch_size": 16, "model__num_encoder_layers": 1,
              "model__num_decoder_layers": 1, "model__emb_dim": 32,
              "model__num_heads": 2, "model__head_dim": 16,
              "model__mlp_dim": 64, "train__batch_size": 16,
              "pipeline__stages": ""}.items()]]
  result = subprocess.run(args, env=quiet_env(), capture_output=True,
                          text=True, cwd=REPO)
  assert result.returncode == 1, result.stderr
  assert result.stdout.splitlines()[-1] == "collector: True True", (
      result.stdout)
  lines = result.stderr.splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("error: Could not write the checkpoint of step 1")
  assert "the disk is full" in lines[0]
  assert not _leftovers(tmp_path / "run")


def _disk_usage(path) -> int:
  """Bytes the files under `path` take on a tmpfs (whole 4 KiB pages)."""
  page = 4096
  return sum(-(-os.path.getsize(os.path.join(folder, name)) // page) * page
             for folder, _, names in os.walk(path) for name in names)


@pytest.fixture
def small_disk(tmp_path):
  """Mounts a tmpfs of a given size at tmp_path / "disk" (unmounted after);
  a real file system that fills up while orbax writes."""
  mounted = []

  def mount(size_bytes):
    if os.geteuid() != 0:
      pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}",
                    "tmpfs", str(path)], check=True)
    mounted.append(path)
    return path

  yield mount
  for path in mounted:
    subprocess.run(["umount", str(path)], check=False)


def test_a_disk_that_fills_in_the_middle_of_a_checkpoint_prints_one_line(
    reference, small_disk):
  """The copy of the reference run (checkpoints 2 and 4) resumes on a disk
  with room for a third of a checkpoint more: the write of step 6 fails part of
  the way through, in orbax's many concurrent writes. The console gets one
  line and nothing after it (no "Task exception was never retrieved" of
  the writes that failed with it); the checkpoints stay and verify."""
  step_size = _disk_usage(reference / "checkpoints" / "2")
  disk = small_disk(_disk_usage(reference) + step_size * 3 // 10)
  run = _copy(reference, disk)
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main",
       f"--config={REPO / 'configs' / 'quickstart.py'}", f"--workdir={run}",
       *cli_args(train__num_steps=8, checkpoint__every_steps=2,
                 checkpoint__keep=3)],
      env=quiet_env(), capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 1, result.stderr
  assert len(result.stderr.splitlines()) == 1, result.stderr
  assert result.stderr.startswith(
      "error: Could not write the checkpoint of step 6")
  assert "the disk is full" in result.stderr
  assert _steps(run) == [2, 4] and not _leftovers(run)
  # The kept checkpoints verify: the same command resumes from step 4.
  checkpointer = checkpointing.Checkpointer(str(run / "checkpoints"), keep=3)
  try:
    assert checkpointer._verified_step(_steps(run)) == STEPS  # pylint: disable=protected-access
  finally:
    checkpointer.close()


# --- 5. smaller faults -------------------------------------------------------


def test_a_resume_that_changes_what_defines_the_run_is_refused_naming_it(
    reference, tmp_path):
  run = _copy(reference, tmp_path)
  shutil.rmtree(run / "checkpoints" / str(STEPS))
  before = {p: (run / p).read_text() for p in ("config.json", "metrics.jsonl")}
  with pytest.raises(workdir_lib.ConfigChangedError) as error:
    loop.train(_config(train__batch_size=8, seed=3), str(run))
  message = str(error.value)
  assert "\n" not in message
  assert "config.train.batch_size 16 -> 8" in message
  assert "config.seed 0 -> 3" in message and "at step 2" in message
  assert {p: (run / p).read_text() for p in before} == before
  assert _steps(run) == [2]


def test_a_restart_before_the_first_checkpoint_logs_step_0_once(
    reference, tmp_path, monkeypatch):
  run = tmp_path / "run"

  def killed(*args):
    raise SystemExit("killed after the step-0 evaluation")

  with monkeypatch.context() as fault:
    # Dies as the first step starts.
    fault.setattr(loop.sharding, "global_batch", killed)
    with pytest.raises(SystemExit):
      loop.train(_config(), str(run))
  assert [r["step"] for r in _rows(run)] == [0]
  loop.train(_config(), str(run))
  _assert_same_run(run, reference)


def test_the_nonfinite_error_says_what_was_kept_and_what_to_change():
  metrics = {"loss": float("nan"), "grad_norm": float("inf")}
  clipped = tiny_config(optimizer__grad_clip_norm=1.0)
  first = loop._nonfinite_message(clipped, 3, metrics, None)
  assert "Step 3 produced a non-finite loss" in first
  assert "None" not in first and "no checkpoint had been saved yet" in first
  # Clipping is on: it is not suggested as something to enable.
  assert "enable" not in first and "grad_clip_norm, now 1" in first
  later = loop._nonfinite_message(
      tiny_config(optimizer__grad_clip_norm=0.0), 9, metrics, 8)
  assert "the last good checkpoint (step 8) is untouched" in later
  assert "resume from step 8" in later
  assert "attention mask" not in later
  # cuDNN's attention gives a row with padding between its real tokens NaN.
  cudnn = loop._nonfinite_message(
      tiny_config(model__attention_impl="dot_product_cudnn"), 9, metrics, 8)
  assert "padding between real tokens" in cudnn and cudnn.endswith(".")
  # 'auto' says so where it resolved to cuDNN's kernel (a Hopper GPU), not
  # elsewhere.
  auto = tiny_config(model__attention_impl="auto")
  assert "padding between real tokens" in loop._nonfinite_message(
      auto, 9, metrics, 8, "dot_product_cudnn")
  assert "attention mask" not in loop._nonfinite_message(
      auto, 9, metrics, 8, "xla")


@pytest.mark.parametrize("field,value", [
    ("dpo.beta", -0.1), ("kto.beta", -0.1), ("checkpoint.every_steps", -1)])
def test_bad_values_are_refused_naming_the_config_field(field, value):
  config = tiny_config(algorithm=field.split(".")[0]
                       if field.split(".")[0] in algorithms.NAMES else "sft")
  defaults.apply_overrides(config, {field: value})
  with pytest.raises(ValueError, match=rf"^config\.{field}: {value} must be"):
    loop.preflight(config, "/unused")


# --- 6. signals in the last phase, and the ETA ------------------------------


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_during_the_final_evaluation(reference, tmp_path, capsys,
                                             monkeypatch, signals):
  """One SIGTERM: the evaluation finishes and the run says so. Two: it
  stops, says so, and a rerun evaluates the saved final checkpoint."""

  def evaluate(trainer, state):
    if int(state.step) == STEPS:
      for _ in range(signals):
        os.kill(os.getpid(), signal.SIGTERM)
    return _constant_evaluation(trainer, state)

  run = tmp_path / "run"
  with monkeypatch.context() as patch:
    patch.setitem(algorithms.REGISTRY, "sft", evaluated_by(
        algorithms.get("sft"), evaluate))
    capsys.readouterr()
    loop.train(_config(), str(run))
  out = capsys.readouterr().out
  if signals == 1:
    assert ("Received SIGTERM during the final evaluation: finished it "
            "first") in out
  else:
    assert ("Received SIGTERM twice during the final evaluation: stopped "
            f"it. The checkpoint at step {STEPS} is saved") in out
    assert all(r["step"] < STEPS or "eval/score" not in r for r in _rows(run))
    loop.train(_config(), str(run))  # evaluates, trains nothing
  _assert_same_run(run, reference)


def test_eta_leaves_out_the_first_steps_compilation(monkeypatch):
  clock = [0.0]
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: clock[0])
  progress = metrics_lib.Progress(total_steps=20)
  clock[0] += 100.0  # the first step compiles for 100 s
  progress.first_step_done(1)
  assert "first step 100.0 s (compilation included)" in progress.line(
      1, 1.0, 0)
  clock[0] += 9.0  # then 1 s per step
  line = progress.line(10, 1.0, 900)
  assert "1.00 steps/s" in line and "100 tokens/s" in line
  assert line.endswith("ETA 0:00:10")


# --- 4. bad inputs -----------------------------------------------------------


def _trajectories(path, rows):
  if str(path).endswith(".parquet"):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    pq.write_table(pa.Table.from_pylist(rows), str(path))
  else:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


GOOD_ROW = {"prompt": "summarize: red", "completion": "red", "reward": 0.5}


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_reward_stored_as_a_string_is_a_bad_row_in_both_modes(tmp_path,
                                                                 suffix):
  from jaxrlhf.data import file_sources  # pylint: disable=g-import-not-at-top
  # In Parquet the whole column is strings (an export that wrote text).
  rows = [dict(GOOD_ROW, reward=str(GOOD_ROW["reward"]))] * 2 + [
      dict(GOOD_ROW, reward="0.4")]
  if suffix == "jsonl":
    rows = [GOOD_ROW, GOOD_ROW, dict(GOOD_ROW, reward="0.4")]
  path = _trajectories(tmp_path / f"t.{suffix}", rows)
  strict = file_sources.AlignmentFileSource(path, kind="trajectory")
  with pytest.raises(file_sources.BadRowError) as error:
    strict.examples()
  first_string = 1 if suffix == "parquet" else 3
  assert str(error.value).startswith(
      f"{path}: row {first_string}: non_finite_reward: 'reward' is a string")
  lenient = file_sources.AlignmentFileSource(
      path, kind="trajectory", on_bad_row="skip_and_report")
  if suffix == "parquet":
    with pytest.raises(ValueError, match="no usable example in 3 rows"):
      lenient.examples()
  else:
    assert [e["reward"] for e in lenient.examples()] == [0.5, 0.5]
    assert lenient.bad_row_counts() == {"non_finite_reward": 1}


def test_a_damaged_parquet_file_is_named(tmp_path):
  from jaxrlhf.data import file_sources  # pylint: disable=g-import-not-at-top
  path = _trajectories(tmp_path / "t.parquet", [GOOD_ROW] * 50)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  source = file_sources.AlignmentFileSource(path, kind="trajectory")
  with pytest.raises(file_sources.UnreadableFileError) as error:
    source.examples()
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"{path}: cannot be read as Parquet (")


def test_skipped_rows_are_counted_in_metrics_jsonl(tmp_path, monkeypatch):
  from conftest import from_scratch  # pylint: disable=g-import-not-at-top
  pair = {"prompt": "summarize: red", "chosen": "red", "rejected": "blue"}
  rows = [pair] * 8 + [dict(pair, rejected=""), dict(pair, margin="0.4"),
                       dict(pair, margin=float("nan"))]
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  config = tiny_config(algorithm="reward_model", data__task="fault_rm_pairs",
                       init__policy_checkpoint="", train__num_steps=1,
                       train__batch_size=4)
  config.data.files.train = str(path)
  config.data.files.on_bad_row = "skip_and_report"
  monkeypatch.setitem(algorithms.REGISTRY, "reward_model", evaluated_by(
      from_scratch(algorithms.get("reward_model"))))
  loop.train(config, str(tmp_path / "run"))
  first = _rows(tmp_path / "run")[0]
  assert first["step"] == 0
  assert {k: v for k, v in first.items() if k.startswith("data/")} == {
      "data/bad_rows/train": 3.0,
      "data/bad_rows/train/empty_completion": 1.0,
      "data/bad_rows/train/non_finite_reward": 2.0}


# --- every numeric config field has a range ----------------------------------


def test_a_numeric_field_without_a_range_cannot_be_declared():
  with pytest.raises(ValueError, match="needs bounds="):
    config_schema.Field("beta", 0.1, "A weight.")
  with pytest.raises(ValueError, match="needs bounds="):
    config_schema.Field("steps", None, "Steps.", type=int)
  config_schema.Field("penalty", -1.0, "Any.", bounds=config_schema.ANY_NUMBER)


def _outside(bounds):
  if bounds.low is not None:
    return bounds.low - 1 if not bounds.low_open else bounds.low
  if bounds.high is not None:
    return bounds.high + 1 if not bounds.high_open else bounds.high
  return float("inf")  # any finite number: an infinity is refused


def test_every_numeric_field_of_every_algorithm_is_range_checked():
  checked = 0
  for name in algorithms.NAMES:
    groups = list(defaults.SHARED) + list(algorithms.get(name).config_groups)
    for path, field in config_schema.walk(groups):
      if not field.is_numeric or field.choices is not None:
        continue
      config = defaults.base_config()
      config.algorithm = name
      value = _outside(config_schema.parse_bounds(field.bounds))
      if field.type is int or isinstance(field.default, int):
        value = int(value) if np.isfinite(value) else value
        if not np.isfinite(value):
          continue  # an int field cannot hold an infinity
      defaults.apply_overrides(config, {path: value})
      with pytest.raises(ValueError, match=rf"^config\.{path}: "):
        defaults.validate(config)
      checked += 1
  assert checked > 100

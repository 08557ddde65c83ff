"""End-to-end behaviour of the SFT run: resume, preemption, faults, config."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, cli_args, evaluated_by, from_scratch, quiet_env
from conftest import tiny_config
from jaxrlhf import algorithms
from jaxrlhf.algorithms.offline import sft
from jaxrlhf.algorithms import trainer as trainer_lib
from jaxrlhf.algorithms import update
from jaxrlhf import checkpoint_files
from jaxrlhf.data import file_sources
from jaxrlhf.losses import sft_losses as sft_losses
from jaxrlhf import sharding
from jaxrlhf.train import loop


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _train_losses(workdir):
  return {r["step"]: r["loss"] for r in _metrics(workdir) if "loss" in r}


def _saved_params(workdir, step=None):
  ckpt_dir = os.path.join(workdir, "checkpoints")
  if step is None:
    step = max(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  state = checkpoint_files.restore_state_as_numpy(
      os.path.join(ckpt_dir, str(step), "state"))
  return step, state["params"]["policy"]


def _main(workdir, *flags):
  """The command line with `flags`; a --config among them replaces the
  quickstart's."""
  config = [f for f in flags if f.startswith("--config=")] or [
      f"--config={REPO / 'configs' / 'quickstart.py'}"]
  return [sys.executable, "-m", "jaxrlhf.main", *config,
          f"--workdir={workdir}",
          *[f for f in flags if not f.startswith("--config=")]]


def test_sigterm_then_resume_equals_uninterrupted_run(tmp_path):
  flags = cli_args(train__num_steps=150, checkpoint__every_steps=50)
  straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
  subprocess.run(_main(straight, *flags), check=True, env=quiet_env(),
                 capture_output=True, cwd=REPO)

  proc = subprocess.Popen(_main(interrupted, *flags), env=quiet_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=REPO)
  metrics_file = interrupted / "metrics.jsonl"
  deadline = time.time() + 900
  # Signal only once training is under way (step 10 logged): the handler is
  # installed by then, and 140 steps remain.
  while not (metrics_file.exists() and any(
      json.loads(l).get("step", 0) >= 10 for l in open(metrics_file)
      if l.endswith("\n"))):
    assert proc.poll() is None, proc.communicate()[0]
    assert time.time() < deadline, "the run never reached step 10"
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  assert "Received SIGTERM" in out and "saved a checkpoint at step" in out
  stopped_at, _ = _saved_params(interrupted)
  assert 10 <= stopped_at < 150, "the signal did not arrive part-way"

  resumed = subprocess.run(_main(interrupted, *flags), env=quiet_env(),
                           capture_output=True, text=True, cwd=REPO)
  assert resumed.returncode == 0, resumed.stderr
  assert f"Resumed from checkpoint at step {stopped_at}" in resumed.stdout

  # Bit-exact on CPU: the same losses at every step and the same parameters.
  expected = _train_losses(straight)
  assert sorted(expected) == list(range(1, 151))
  assert _train_losses(interrupted) == expected
  _, a = _saved_params(straight, 150)
  _, b = _saved_params(interrupted, 150)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  # The resolved config was written into the workdir.
  written = json.load(open(interrupted / "config.json"))
  assert written["train"]["num_steps"] == 150
  assert written["model"]["emb_dim"] == 32


class _PoisonedBatches:
  """SFT batches that carry a "poison" factor: NaN from the 6th batch on."""

  def __init__(self, batches):
    self._batches = batches

  @property
  def position(self):
    return self._batches.position

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self._batches)
    rows = len(batch["decoder_loss_weights"])
    poison = np.nan if self._batches.position >= 6 else 1.0
    return dict(batch, poison=np.full((rows,), poison, np.float32))


def _poisoned_sft_loss(trainer, params, state, batch, rng):
  loss, metrics = sft.loss(trainer, params, state, batch, rng)
  return loss * jnp.mean(batch["poison"]), metrics


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path,
                                                             monkeypatch):
  train_batches = trainer_lib.Trainer.train_batches
  monkeypatch.setattr(
      trainer_lib.Trainer, "train_batches",
      lambda self, position: _PoisonedBatches(train_batches(self, position)))
  monkeypatch.setitem(algorithms.REGISTRY, "sft", dataclasses.replace(
      sft.ALGORITHM, training=dataclasses.replace(
          sft.ALGORITHM.training, loss=_poisoned_sft_loss)))
  config = tiny_config(train__num_steps=12, checkpoint__every_steps=2,
                       train__log_every=4)
  with pytest.raises(loop.NonFiniteError, match=r"Step 6 .*non-finite.*step 4"):
    loop.train(config, str(tmp_path))
  step, params = _saved_params(tmp_path)
  assert step == 4
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  # Steps before the fault were logged; nothing at or after it.
  assert max(_train_losses(tmp_path)) == 5


def test_guarded_update_skips_nonfinite_gradients():
  import optax
  tx = optax.sgd(0.1)
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  good = update.guarded_update(params, opt_state, {"w": jnp.ones(3)},
                               jnp.float32(1.0), tx, {})
  np.testing.assert_allclose(good[0]["w"], 0.9)
  assert good[2]["nonfinite"] == 0
  bad = update.guarded_update(params, opt_state,
                              {"w": jnp.array([1.0, jnp.inf, 0.0])},
                              jnp.float32(1.0), tx, {})
  np.testing.assert_array_equal(bad[0]["w"], 1.0)
  assert bad[2]["nonfinite"] == 1


def test_half_written_checkpoint_is_never_restored(tmp_path, capsys):
  config = tiny_config(train__num_steps=8, checkpoint__every_steps=4)
  loop.train(config, str(tmp_path))
  ckpts = tmp_path / "checkpoints"
  # A save of step 12 that crashed mid-write: orbax writes into a temporary
  # directory and renames it only once complete.
  partial = ckpts / "12.orbax-checkpoint-tmp-1795000000"
  shutil.copytree(ckpts / "8", partial)
  shutil.rmtree(partial / "state")
  config.train.num_steps = 12
  loop.train(config, str(tmp_path))
  assert "Resumed from checkpoint at step 8" in capsys.readouterr().out
  assert sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()) == [8, 12]
  assert not partial.exists()


def test_finished_run_is_not_evaluated_again_and_refused_run_keeps_config(
    tmp_path, capsys):
  config = tiny_config(train__num_steps=2)
  first = loop.train(config, str(tmp_path))
  metrics = (tmp_path / "metrics.jsonl").read_text()
  run_config = (tmp_path / "config.json").read_text()
  last = json.loads(metrics.splitlines()[-1])
  assert last["step"] == 2 and "eval/gold_reward" in last
  # Run again: nothing to train, nothing logged twice, the same summary.
  again = loop.train(config, str(tmp_path))
  assert "Already at step 2 of 2" in capsys.readouterr().out
  assert (tmp_path / "metrics.jsonl").read_text() == metrics
  assert {k: v for k, v in again.items() if k.startswith("eval/")} == {
      k: v for k, v in last.items() if k.startswith("eval/")}
  assert again["eval_before/gold_reward"] == first["eval_before/gold_reward"]
  # A run that cannot restore the workdir's checkpoint (another model
  # shape) fails at start-up and leaves the config of the checkpoints.
  other = tiny_config(train__num_steps=4, model__mlp_dim=48)
  with pytest.raises(ValueError, match=r"Checkpoint step 2 in .* was written "
                     r"for another model: \['params'\]\['policy'\].*"
                     r"\(32, 64\) there, \(32, 48\) here"):
    loop.train(other, str(tmp_path))
  assert (tmp_path / "config.json").read_text() == run_config


def test_bad_data_stops_the_run_before_the_first_evaluation(tmp_path,
                                                            monkeypatch):
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps({"prompt": "summarize: red", "chosen": "red",
                              "rejected": ""}) + "\n")  # empty completion
  config = tiny_config(algorithm="reward_model", data__task="bad_rm_pairs",
                       init__policy_checkpoint="")
  config.data.files.train = str(path)
  evaluated = []
  monkeypatch.setitem(algorithms.REGISTRY, "reward_model", evaluated_by(
      from_scratch(algorithms.get("reward_model")),
      lambda trainer, state: evaluated.append(1) or {}))
  with pytest.raises(file_sources.BadRowError, match="row 1: empty_completion"):
    loop.train(config, str(tmp_path / "run"))
  assert not evaluated
  assert not (tmp_path / "run" / "config.json").exists()


def test_microbatches_give_the_full_batch_gradient():
  config = tiny_config()
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  with jax.set_mesh(mesh):
    trainer = algorithms.build(config, mesh)
    state = trainer.init_state()
  batch = next(trainer.train_batches(0))
  denom = float(np.maximum(batch["decoder_loss_weights"].sum(), 1))

  def loss_fn(params, mb, rng):
    logits = trainer.lm.completion_logits(params["policy"], mb)
    loss, m = sft_losses.cross_entropy_loss(
        logits, mb["decoder_target_tokens"], mb["decoder_loss_weights"])
    return loss * jnp.maximum(m["weight_sum"], 1.0) / denom, m

  rng = jax.random.PRNGKey(0)
  full = update.accumulate_gradients(loss_fn, state.params, batch, rng, 1)
  micro = update.accumulate_gradients(loss_fn, state.params, batch, rng, 4)
  np.testing.assert_allclose(micro[0], full[0], rtol=1e-5)
  np.testing.assert_allclose(micro[1]["weight_sum"], full[1]["weight_sum"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               micro[2], full[2])


@pytest.mark.parametrize("algorithm,overrides,statistic", [
    ("kto", {}, "KL baseline z0 and which completions are desirable"),
    ("kto_thumbs", {}, "KL baseline z0"),
    ("dro_v", {"dro__single_value_per_batch": True}, "one per batch"),
])
def test_micro_batches_are_refused_where_the_loss_uses_batch_statistics(
    algorithm, overrides, statistic):
  """KTO's KL baseline and batch-mean desirability, DRO-V's single value per
  batch: a micro-batch's estimate is another loss, so it is refused before
  anything is written (the loop's preflight runs this check)."""
  config = tiny_config(algorithm=algorithm, train__num_microbatches=2,
                       **overrides)
  with pytest.raises(ValueError, match=statistic) as error:
    algorithms.check_rows(config, 1)
  assert str(error.value).startswith("config.train.num_microbatches: ")
  config.train.num_microbatches = 1
  algorithms.check_rows(config, 1)
  # DRO-V with a value per prompt is a mean over examples: micro-batches
  # add up to the batch.
  algorithms.check_rows(tiny_config(algorithm="dro_v",
                                    train__num_microbatches=2), 1)


@pytest.mark.parametrize("flags,message", [
    (["--config.model.no_such_field=1"],
     "unknown config field 'model.no_such_field'"),
    (["--config.dpo.los_type=ipo"],  # with ml_collections' suggestion
     "'dpo' has no field 'los_type'. Did you mean \"loss_type\""),
    (["--config.train.num_steps=many"], "--config.train.num_steps=many"),
    (["--config.data.task=no_such_task"],
     "no seqio task or mixture named 'no_such_task'"),
    (["--config.train.num_microbatches=3"],
     "config.train.num_microbatches: 3 does not divide"),
    (["--config=configs/nope.py"], "--config=configs/nope.py: no such file"),
    # The README's own 8-device example, on one device.
    (["--config.mesh.shape=(4,2)"],
     "config.mesh.shape (4, 2) needs 8 devices but 1 are available"),
    (["--config=configs/dro_t5xl.py", "--config.mesh.shape=(-1,1)"],
     "config.init.policy_checkpoint: 'gs://YOUR_BUCKET/"),
    (["--config.data.files.vocabulary=gs://no-such-bucket-jaxrlhf/v.model",
      "--config.data.task=remote_vocabulary"],
     "config.data.files.vocabulary: "),
])
def test_bad_config_gives_one_line_error(tmp_path, flags, message):
  result = subprocess.run(_main(tmp_path / "run", *flags), env=quiet_env(),
                          capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 2
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert message in lines[0], result.stderr
  # Refused before anything was written.
  assert not (tmp_path / "run").exists()


def test_help_lists_the_flags_and_exits_0():
  result = subprocess.run([sys.executable, "-m", "jaxrlhf.main", "--help"],
                          env=quiet_env(), capture_output=True, text=True,
                          cwd=REPO)
  assert result.returncode == 0, result.stderr
  assert "--config=" in result.stdout and "--workdir=" in result.stdout
  assert "--config.<field>=value" in result.stdout
  assert "default: 'None'" not in result.stdout
  assert result.stderr == ""


@pytest.mark.parametrize("first", ["", "import jax\n"])
def test_tensorflow_is_imported_only_when_needed_and_then_quietly(first):
  """The models, samplers and --help start without TensorFlow; its first
  import (seqio's, here) prints none of its C++ start-up lines (on a
  machine without a GPU it announces the CUDA drivers it did not find) and
  sees no GPU; also after JAX was imported first, as a notebook does."""
  code = first + (
      "import sys\n"
      "import jaxrlhf.models.pretrained, jaxrlhf.models.sampling\n"
      "from jaxrlhf import main\n"
      "print('before', 'tensorflow' in sys.modules)\n"
      "import seqio\n"
      "import tensorflow as tf\n"
      "print('after', 'tensorflow_text' in sys.modules,\n"
      "      tf.config.get_visible_devices('GPU'))\n")
  env = quiet_env()
  env.pop("TF_CPP_MIN_LOG_LEVEL")  # as a user's shell has it
  result = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines() == ["before False", "after True []"]
  assert result.stderr == ""


def test_unwritable_workdir_gives_one_line_error(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  result = subprocess.run(_main(blocker / "run"), env=quiet_env(),
                          capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 2
  assert "is not a writable directory" in result.stderr
  assert "Traceback" not in result.stderr


def test_a_new_run_loads_its_checkpoints_and_initialises_only_the_rest(
    tmp_path):
  """DRO-V from an SFT checkpoint: the policy, the frozen reference and the
  value network's backbone are the checkpoint's; the value head is the
  seeded initialisation a run without checkpoints gets; the optimizer
  state is the optimizer's initialisation of those parameters; and the
  loaded networks' random initialisation is never computed (the compiled
  init does fewer operations than one that initialises every network)."""
  from jaxrlhf.models import pretrained  # pylint: disable=g-import-not-at-top
  from jaxrlhf.algorithms import state as state_lib  # pylint: disable=g-import-not-at-top
  sft_dir = str(tmp_path / "sft")
  loop.train(tiny_config(train__num_steps=2, checkpoint__every_steps=0),
             sft_dir)
  config = tiny_config(algorithm="dro_v", init__policy_checkpoint=sft_dir)
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  with jax.set_mesh(mesh):
    trainer = algorithms.build(config, mesh)
    assert set(trainer.algorithm.networks.checkpoints(trainer)) >= {
        "params/policy", "frozen/reference", "params/value/backbone"}
    state = trainer.init_state()
    rng = jax.random.PRNGKey(config.seed)
    fresh = trainer._init(rng)  # pylint: disable=protected-access
    saved = pretrained.load_network_params(sft_dir, fresh.params["policy"],
                                           "policy")
    opt_init = trainer.tx.init(state.params)
    abstract = state_lib.abstract_with_shardings(trainer.abstract_state,
                                                 trainer.state_shardings)
    targets = trainer.algorithm.networks.checkpoints(trainer)
    cost = lambda loaded: trainer._init.lower(  # pylint: disable=protected-access
        rng, loaded).compile().cost_analysis()
    cost_all = cost(None)
    cost_loaded = cost({t: state_lib.subtree(abstract, t) for t in targets})
  same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  same(state.params["policy"], saved)
  same(state.frozen["reference"], saved)
  same(state.params["value"]["backbone"], saved)
  with pytest.raises(AssertionError):  # the checkpoint is not the seeded init
    same(fresh.params["policy"], saved)
  value_head = {k: v for k, v in state.params["value"].items()
                if k != "backbone"}
  assert value_head
  same(value_head, {k: fresh.params["value"][k] for k in value_head})
  same(state.opt_state, opt_init)
  assert cost_loaded["flops"] < 0.5 * cost_all["flops"]

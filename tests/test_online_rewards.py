"""Online RL on rewards from several sources: a reward model, the task's
gold reward, a function named by its import path and the math verifier,
summed with their weights and each logged; the step split around the host;
DAPO's dynamic sampling; PPO's value from the policy without a reward
model; a failing reward function named in one line, and waited for: no
computation of the step is left running when the run stops.

Truths used: the rewards recomputed here from the decoded samples with the
task's own gold reward, the function itself and the reward model's scores
(the same samples: the step's random key); the fused compiled step, which
the split step must equal when the host adds 0; the prompts' text.
"""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, cli_args, quiet_env, tiny_config
from jaxrlhf import algorithms
from jaxrlhf import checkpoint_files
from jaxrlhf import plan as plan_lib
from jaxrlhf import sharding
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.data import synthetic_arithmetic
from jaxrlhf.eval import evaluation
from jaxrlhf.models import heads
from jaxrlhf.rewards import math_answer
from jaxrlhf.train import checkpointing
from jaxrlhf.train import loop

TASK = "synthetic_arithmetic"


def _write_workdir(path, config, state):
  loop.prepare_workdir(str(path), config)
  ckpt = checkpointing.Checkpointer(os.path.join(path, "checkpoints"), keep=1)
  ckpt.save(1, state, 0)
  ckpt.close()


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
  """A random tiny "SFT" policy on the arithmetic task and a reward model
  on its backbone."""
  root = tmp_path_factory.mktemp("online_rewards")
  config = tiny_config(algorithm="sft", data__task=TASK)
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = algorithms.build(config, mesh, evaluate=False)
    state = trainer.init_state()
  _write_workdir(root / "sft", config, state)
  reward = nn.unbox(heads.init_from_backbone(
      jax.random.PRNGKey(7), state.params["policy"],
      trainer.model_config.emb_dim))
  reward_state = state_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params={"reward": reward}, opt_state={},
      frozen={}, rng=jax.random.PRNGKey(0), algorithm_state={})
  _write_workdir(root / "rm",
                 tiny_config(algorithm="reward_model", data__task=TASK),
                 reward_state)
  return {"sft": str(root / "sft"), "rm": str(root / "rm")}


def _config(workdirs, algorithm="grpo", **overrides):
  base = dict(algorithm=algorithm, data__task=TASK,
              init__policy_checkpoint=workdirs["sft"],
              online__reward_model_checkpoint=workdirs["rm"],
              online__samples_per_prompt=2, optimizer__warmup_steps=0,
              train__batch_size=4, eval__num_examples=8)
  base.update(overrides)
  return tiny_config(**base)


def _step(config, steps=1):
  """(trainer, state before, batches, states and metrics of `steps`)."""
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = algorithms.build(config, mesh, evaluate=False)
    state = trainer.init_state()
    batches = trainer.train_batches(0)
    out = []
    for _ in range(steps):
      batch = sharding.global_batch(next(batches), mesh, trainer.rules)
      # (The step donates the state it is given.)
      first = (jax.tree.map(jnp.copy, state), batch)
      state, metrics = trainer.train_step(state, batch)
      out.append((first, jax.device_get(metrics)))
  return trainer, out


def test_every_source_sums_with_its_weight_and_is_logged(workdirs):
  """The reward model (0.5), the gold reward (1), a function by path (0.1)
  and the math verifier (2): the step's score is their weighted sum on the
  responses it sampled, each reward's mean is logged, with its share."""
  config = _config(workdirs, rewards__reward_model__weight=0.5,
                   rewards__gold_reward__weight=1.0,
                   rewards__math_answer__weight=2.0,
                   rewards__math_answer__style="gsm8k",
                   rewards__functions="reward_functions:word_count=0.1",
                   optimizer__learning_rate=0.0)
  trainer, [((state, batch), metrics)] = _step(config)
  # The same samples: the step's rollout key.
  _, rollout_rng, _ = iteration.split_step_key(state.rng)
  with sharding.activate(config, jax.devices()[:1]):
    samples = iteration.sample(trainer, state.params, state.frozen,
                               batch["encoder_input_tokens"], rollout_rng)
    rm = reward_sources.reward_scores(
        trainer, state.frozen["reward"],
        np.repeat(np.asarray(batch["encoder_input_tokens"]), 2, axis=0),
        jax.device_get(samples))
  vocabulary = trainer.vocabulary
  prompts = trainer.online.prompt_source.prompts
  index = np.repeat(np.asarray(batch["prompt_index"]), 2)
  texts = [vocabulary.decode(evaluation.until_eos(t, vocabulary.eos_id))
           for t in np.asarray(samples.tokens)]
  finished = np.asarray(samples.has_eos)
  gold = np.array([synthetic_arithmetic.gold_reward(prompts.texts[i], t, f)
                   for i, t, f in zip(index, texts, finished)])
  words = np.array([len(t.split()) for t in texts], np.float64)
  answers = [prompts.columns["answer"][i] for i in index]
  verified = np.array(math_answer.make_math_answer_reward(style="gsm8k")(
      None, texts, answer=answers), np.float64)
  score = 0.5 * rm + gold + 0.1 * words + 2.0 * verified
  np.testing.assert_allclose(metrics["score"], score.mean(), rtol=1e-5)
  for name, values in (("reward_model", rm), ("gold_reward", gold),
                       ("word_count", words), ("math_answer", verified)):
    np.testing.assert_allclose(metrics[f"reward/{name}"], values.mean(),
                               rtol=1e-5, atol=1e-6)
  shares = [metrics[f"reward/{n}_share"] for n in
            ("reward_model", "gold_reward", "word_count", "math_answer")]
  np.testing.assert_allclose(sum(shares), 1.0, rtol=1e-5)
  np.testing.assert_allclose(metrics["reward/word_count_share"],
                             0.1 * words.sum() / (
                                 0.5 * np.abs(rm).sum() + gold.sum()
                                 + 0.1 * words.sum() + 2 * verified.sum()),
                             rtol=1e-4)


def test_the_split_step_equals_the_fused_one_when_the_host_adds_0(workdirs):
  """The reward model alone (one compiled step) against the reward model
  plus a function that scores 0 (the step split around the host): the
  same samples, scores and update."""
  fused_config = _config(workdirs)
  split_config = _config(workdirs, rewards__functions="reward_functions:zero")
  fused, [(_, fused_metrics)] = _step(fused_config)
  split, [(_, split_metrics)] = _step(split_config)
  assert not hasattr(fused.train_step, "fused")
  assert hasattr(split.train_step, "fused")
  for name in ("score", "raw_score", "kl", "loss", "response_length",
               "grad_norm"):
    np.testing.assert_allclose(split_metrics[name], fused_metrics[name],
                               rtol=1e-5, atol=1e-7, err_msg=name)
  # `jaxrlhf.plan` lays out the split step's device work as one function.
  planned = plan_lib.make_plan(split_config, jax.devices()[:1])
  assert planned["flops_per_chip_per_step"] > 0


def test_a_run_without_a_reward_model_holds_none(workdirs):
  """The gold reward alone: no reward model checkpoint is needed, none is
  held; PPO's value network then starts from the policy."""
  config = _config(workdirs, algorithm="ppo",
                   online__reward_model_checkpoint="",
                   rewards__reward_model__weight=0.0,
                   rewards__gold_reward__weight=1.0,
                   online__samples_per_prompt=1)
  trainer, [((state, _), metrics)] = _step(config)
  assert "reward" not in state.frozen and "raw_score" not in metrics
  assert np.isfinite(metrics["loss"]) and "reward/gold_reward" in metrics
  policy = checkpoint_files.restore_state_as_numpy(os.path.join(
      workdirs["sft"], "checkpoints", "1", "state"))["params"]["policy"]
  jax.tree.map(np.testing.assert_array_equal,
               jax.device_get(state.params["value"]["backbone"]), policy)
  del trainer


def test_no_reward_at_all_is_refused_naming_the_field(workdirs):
  config = _config(workdirs, rewards__reward_model__weight=0.0)
  with pytest.raises(ValueError, match=r"^config.rewards: every reward's "):
    loop.preflight(config, "/unused")
  config = _config(workdirs, online__reward_model_checkpoint="")
  with pytest.raises(ValueError,
                     match=r"^config.online.reward_model_checkpoint: .*set "
                     "rewards.reward_model.weight=0"):
    loop.preflight(config, "/unused")


def test_dynamic_sampling_trains_on_groups_that_vary(workdirs):
  """A reward that scores every response of some prompts the same: such
  groups are dropped and more prompts sampled (the prompt stream moves
  on), up to the cap of rounds."""
  config = _config(
      workdirs, rewards__reward_model__weight=0.0,
      rewards__functions="reward_functions:first_prompt_word_is_even",
      grpo__dynamic_sampling=True, grpo__max_sampling_rounds=3)
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = algorithms.build(config, mesh, evaluate=False)
    state = trainer.init_state()
    batches = trainer.train_batches(0)
    batch = sharding.global_batch(next(batches), mesh, trainer.rules)
    state, metrics = trainer.train_step(state, batch)
  rounds = metrics["dynamic_sampling/rounds"]
  assert 1 <= rounds <= 3 and batches.position == rounds
  assert 0 <= metrics["dynamic_sampling/dropped_fraction"] <= 1
  assert np.isfinite(metrics["loss"])


def test_a_failing_reward_function_leaves_no_computation_running(
    workdirs, tmp_path, monkeypatch):
  """The split step scores on the host while the device assembles the
  rollout. When a reward function fails there, the run waits for that
  computation before it closes its files and raises (a process exiting
  under a running XLA computation can crash in its shutdown instead of
  exiting with status 1): observed as the run closes."""
  running_at_close = []
  close = loop._Run.close  # pylint: disable=protected-access

  def observed_close(run):
    running_at_close.append(
        [a.shape for a in jax.live_arrays() if not a.is_ready()])
    close(run)

  monkeypatch.setattr(loop._Run, "close", observed_close)  # pylint: disable=protected-access
  config = _config(workdirs, rewards__reward_model__weight=0.0,
                   rewards__functions="reward_functions:raises",
                   online__samples_per_prompt=8, train__batch_size=64,
                   train__num_steps=1)
  with pytest.raises(loop.RewardFunctionError, match="the grader is down"):
    loop.train(config, str(tmp_path / "run"), jax.devices()[:1])
  assert running_at_close == [[]], running_at_close


def test_a_failing_reward_function_stops_the_run_in_one_line(workdirs,
                                                             tmp_path):
  """On the command line: exit status 1, one line naming the function,
  the row and what went wrong; with skip_and_report the rows are counted
  in metrics.jsonl instead."""
  overrides = dict(algorithm="grpo", data__task=TASK,
                   init__policy_checkpoint=workdirs["sft"],
                   rewards__reward_model__weight=0.0,
                   rewards__functions="reward_functions:raises",
                   online__samples_per_prompt=2, train__batch_size=4,
                   train__num_steps=1, eval__num_examples=8)
  env = quiet_env(PYTHONPATH=str(REPO / "tests"))
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main",
       f"--config={REPO / 'configs' / 'quickstart.py'}",
       f"--workdir={tmp_path / 'run'}", *cli_args(**overrides)],
      env=env, capture_output=True, text=True, cwd=REPO)
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("error: ") and "raises" in lines[0]
  assert "row 0" in lines[0] and "the grader is down" in lines[0]


def test_a_reward_that_applies_to_no_row_logs_its_count_and_no_value():
  """reward/<name> is the mean over the rows a reward applies to, with
  reward/<name>/rows their count; a step where it applies to none logs the
  count 0 and leaves the mean out of the logs (not 0.0)."""
  sources = reward_sources.RewardSources(
      weights={"gold_reward": 1.0, "never": 2.0}, reward_model=None, lm=None,
      host=(), overlong=None, eos_trick=None)
  components = jnp.asarray([[0.5, jnp.nan], [1.0, jnp.nan], [jnp.nan,
                                                              jnp.nan]])
  metrics = {k: float(v) for k, v in sources.metrics(components).items()}
  assert metrics["reward/gold_reward"] == 0.75  # (0.5 + 1) / 2 rows
  assert metrics["reward/gold_reward/rows"] == 2
  assert metrics["reward/never/rows"] == 0
  assert np.isnan(metrics["reward/never"])
  np.testing.assert_allclose(float(sources.combine(components)[0]), 0.5)

  written = []

  class Logger:
    def write(self, step, scalars):
      written.append((step, scalars))

  class Progress:
    def timed(self, step):
      return False

    def line(self, step, loss, tokens):
      return ""

  pending = loop._PendingMetrics(None, Logger(), Progress(), None)  # pylint: disable=protected-access
  pending.add(3, dict(metrics, loss=1.0, kl=float("nan")), 0)
  pending.flush()
  [(step, scalars)] = written
  assert step == 3 and "reward/never" not in scalars
  assert scalars["reward/never/rows"] == 0
  assert np.isnan(scalars["kl"])  # a NaN that is no reward's stays visible


def test_the_gap_to_the_sampler_is_logged_and_a_correction_applies(workdirs):
  """Every step logs the gap between the sampler's own log-probs and the
  trainer's scoring of the same tokens (gap/k1: the mean over responses of
  sum_t log pi_sample - log pi_train, recomputed here from the step's
  rollout). On rows whose tokens avoid the padding id the two agree to
  float32 rounding; a random policy that samples id 0 mid-response is
  scored as padding there, which the gap shows. A correction whose band
  keeps no ratio near 1 (token_mask with [2, 3]) drops every token: the
  loss is 0 and the log says so; without one the step trains on every
  token."""
  config = _config(workdirs, rewards__reward_model__weight=0.0,
                   rewards__gold_reward__weight=1.0)
  trainer, [((state, batch), plain)] = _step(config)
  with sharding.activate(config, jax.devices()[:1]):
    rollout = jax.jit(lambda s, b: iteration.rollout_for_step(
        trainer, s, b))(state, batch)
  mask = np.asarray(rollout.mask, np.float64)
  gap = (np.asarray(rollout.sample_logprobs, np.float64)
         - np.asarray(rollout.logprobs, np.float64)) * mask
  np.testing.assert_allclose(plain["gap/k1"], gap.sum(-1).mean(), rtol=1e-4,
                             atol=1e-5)
  tokens = np.asarray(rollout.features["decoder_target_tokens"])
  clean = ~np.any((tokens == 0) & (mask > 0), axis=-1)
  assert clean.any()
  assert np.abs(gap[clean]).max() < 1e-4
  assert "correction/dropped_fraction" not in plain  # none: the step as is
  assert plain["loss"] != 0.0
  config = _config(workdirs, rewards__reward_model__weight=0.0,
                   rewards__gold_reward__weight=1.0,
                   online__importance_correction="token_mask",
                   online__importance_ratio_low=2.0,
                   online__importance_ratio_high=3.0)
  _, [(_, masked)] = _step(config)
  assert masked["correction/dropped_fraction"] == 1.0
  assert abs(masked["loss"]) < 1e-6  # nothing left to train on
  # The rollout is the same: the correction acts on the update only.
  assert masked["score"] == plain["score"]

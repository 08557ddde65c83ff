"""Algorithm-level behaviour of the online RL algorithms (PPO, RLOO, GRPO,
...).

The pure functions of jaxrlhf.rl have their own tests; here they are
checked as assembled: a real rollout through the EOS trick, the PPO update
against a plain policy-gradient step computed independently, the KL
controller's state through a checkpoint and an exactly resumed run, prompt
cutting at paragraph breaks, prompt order across passes, and the start-up
check of the reward model's vocabulary. Policy and reward model are tiny,
randomly initialised networks written into workdirs by hand.
"""

import json
import os
import re
import shutil

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
import tensorflow as tf

from conftest import tiny_config
from jaxrlhf import algorithms
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import recipe
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import rejection_sampling
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf import checkpoint_files
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data import tasks
from jaxrlhf.data import vocab
from jaxrlhf import defaults
from jaxrlhf.models import heads
from jaxrlhf.rl import rollout as rollout_lib
from jaxrlhf import sharding
from jaxrlhf.train import checkpointing
from jaxrlhf.train import loop

LR = 0.05


def _mesh_context(config):
  return sharding.activate(config, jax.devices()[:1])


def _write_workdir(path, config, state):
  loop.prepare_workdir(str(path), config)
  ckpt = checkpointing.Checkpointer(os.path.join(path, "checkpoints"), keep=1)
  ckpt.save(1, state, 0)
  ckpt.close()


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
  """A random tiny "SFT" policy and a reward model on its backbone."""
  root = tmp_path_factory.mktemp("online")
  config = tiny_config(algorithm="sft")
  with _mesh_context(config) as mesh:
    trainer = algorithms.build(config, mesh)
    state = trainer.init_state()
  _write_workdir(root / "sft", config, state)
  reward = nn.unbox(heads.init_from_backbone(
      jax.random.PRNGKey(7), state.params["policy"],
      trainer.model_config.emb_dim))
  reward_state = state_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params={"reward": reward}, opt_state={},
      frozen={}, rng=jax.random.PRNGKey(0), algorithm_state={})
  _write_workdir(root / "rm", tiny_config(algorithm="reward_model"),
                 reward_state)
  return {"sft": str(root / "sft"), "rm": str(root / "rm"), "root": root}


def _config(workdirs, algorithm="ppo", **overrides):
  base = dict(algorithm=algorithm, init__policy_checkpoint=workdirs["sft"],
              online__reward_model_checkpoint=workdirs["rm"],
              optimizer__warmup_steps=0, train__batch_size=8)
  base.update(overrides)
  return tiny_config(**base)


@pytest.fixture(scope="module")
def sgd_ppo(workdirs):
  """PPO with plain SGD and no clipping, so an update is -LR * gradient
  exactly."""
  config = _config(workdirs, online__num_epochs=1, online__num_minibatches=1,
                   optimizer__name="sgd", optimizer__learning_rate=LR,
                   optimizer__grad_clip_norm=0.0)
  with _mesh_context(config) as mesh:
    trainer = algorithms.build(config, mesh)
    state = trainer.init_state()
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                  trainer.rules)
  return trainer, state, batch


def _numpy_gae(rewards, values, mask, gamma, lam):
  """Backward GAE over each row's masked prefix, in plain Python."""
  advantages = np.zeros_like(rewards)
  for b in range(rewards.shape[0]):
    length = int(mask[b].sum())
    next_value, next_advantage = 0.0, 0.0
    for t in reversed(range(length)):
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      next_advantage = delta + gamma * lam * next_advantage
      advantages[b, t] = next_advantage
      next_value = values[b, t]
  return advantages


def test_ppo_with_one_epoch_and_minibatch_is_the_policy_gradient_step(sgd_ppo):
  """K = 1, N_mb = 1: the ratio is 1, so the clipped objective's gradient is
  -A grad log pi (token mean) and the value loss's is that of 1/2 (V - R)^2:
  the step must equal SGD on those, with A and R from a plain-Python GAE."""
  trainer, state, batch = sgd_ppo
  cfg = trainer.config
  reward_lm = trainer.online.rewards.lm
  with _mesh_context(cfg):
    rollout = jax.jit(lambda s, b: iteration.rollout_for_step(trainer, s,
                                                                b))(
        state, batch)
    values = np.asarray(heads.token_values(
        reward_lm, state.params["value"], rollout.features))
    mask = np.asarray(rollout.mask, np.float64)
    logprobs = np.asarray(rollout.logprobs, np.float64)
    ref = np.asarray(rollout.ref_logprobs, np.float64)
    rewards = -cfg.online.kl_coef * (logprobs - ref) * mask
    last = mask.sum(1).astype(int) - 1
    rewards[np.arange(len(last)), last] += np.asarray(rollout.scores)
    advantages = _numpy_gae(rewards, values * mask, mask, 1.0, 0.95)
    returns = (advantages + values) * mask
    mean = (advantages * mask).sum() / mask.sum()
    var = (np.square(advantages - mean) * mask).sum() / mask.sum()
    whitened = (advantages - mean) / np.sqrt(var + 1e-8) * mask
    assert np.abs(whitened).sum() > 0

    features = rollout.features
    def pg_loss(policy_params):
      lp, _ = trainer.lm.completion_logprobs(
          policy_params, features, temperature=cfg.online.temperature)
      return -jnp.sum(jnp.asarray(whitened, jnp.float32) * lp) / mask.sum()

    def value_loss(value_params):
      v = heads.token_values(reward_lm, value_params, features)
      return cfg.ppo.vf_coef * 0.5 * jnp.sum(
          jnp.square(v - jnp.asarray(returns, jnp.float32)) * mask) / mask.sum()

    expected = {
        "policy": jax.tree.map(lambda p, g: p - LR * g, state.params["policy"],
                               jax.grad(pg_loss)(state.params["policy"])),
        "value": jax.tree.map(lambda p, g: p - LR * g, state.params["value"],
                              jax.grad(value_loss)(state.params["value"])),
    }
    copy = jax.tree.map(jnp.copy, state)
    new_state, metrics = trainer.train_step(copy, batch)
  for name in ("policy", "value"):
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()),
                         new_state.params[name], state.params[name])
    assert max(jax.tree.leaves(moved)) > 1e-4, name  # the step did something
    jax.tree.map(lambda got, want: np.testing.assert_allclose(
        got, want, rtol=1e-4, atol=2e-6), new_state.params[name],
                 expected[name])
  assert float(metrics["clip_fraction"]) == 0.0
  np.testing.assert_allclose(float(metrics["ratio_mean"]), 1.0, atol=1e-5)
  np.testing.assert_allclose(float(metrics["kl"]),
                             ((logprobs - ref) * mask).sum(1).mean(), rtol=1e-4,
                             atol=1e-5)
  assert int(new_state.step) == 1


def test_rollout_truncates_after_eos_scores_at_eos_and_penalises_no_eos(
    sgd_ppo):
  trainer, state, batch = sgd_ppo
  cfg = trainer.config
  reward_lm = trainer.online.rewards.lm
  length = trainer.online.max_new_tokens
  prompts = np.asarray(batch["encoder_input_tokens"])[:3]
  eos = trainer.vocabulary.eos_id
  # Row 0 ends at position 2 and keeps sampling; row 1 ends at 1; row 2
  # never ends.
  responses = np.full((3, length), 9, np.int32)
  responses[0, :3] = [5, 6, eos]
  responses[1, :2] = [5, eos]
  responses[2, :4] = [5, 6, 7, 8]
  assemble = jax.jit(lambda tokens, penalty: rollout_lib.assemble_rollout(
      trainer.lm, state.params["policy"], state.frozen["reference"],
      reward_lm, state.frozen["reward"], jnp.asarray(prompts), tokens,
      temperature=cfg.online.temperature, eos_id=eos,
      missing_eos_penalty=penalty), static_argnums=1)
  with _mesh_context(cfg):
    ro = assemble(jnp.asarray(responses), -1.0)
    # Different tokens after the EOS must change nothing.
    junk = responses.copy()
    junk[0, 3:] = 4
    junk[1, 2:] = 11
    ro_junk = assemble(jnp.asarray(junk), -1.0)
    ro_no_trick = assemble(jnp.asarray(responses), None)

    ends = [2, 1, length - 1]
    targets = responses.copy()
    weights = np.zeros_like(responses)
    for b, end in enumerate(ends):
      targets[b, end + 1:] = 0
      weights[b, :end + 1] = 1
    by_hand = {"encoder_input_tokens": jnp.asarray(prompts),
               "decoder_target_tokens": jnp.asarray(targets),
               "decoder_input_tokens": jnp.asarray(
                   np.pad(targets[:, :-1], ((0, 0), (1, 0)))),
               "decoder_loss_weights": jnp.asarray(weights)}
    reward = state.frozen["reward"]
    hidden, _ = reward_lm.completion_hidden(reward["backbone"], by_hand)
    at_end = np.asarray(hidden)[np.arange(3), ends]
    expected_raw = at_end @ np.asarray(reward["head"]["kernel"]) + float(
        reward["head"]["bias"])
    expected_lp, _ = trainer.lm.completion_logprobs(
        state.params["policy"], by_hand, temperature=cfg.online.temperature)
    expected_ref, _ = trainer.lm.completion_logprobs(
        state.frozen["reference"], by_hand,
        temperature=cfg.online.temperature)

  for key, value in by_hand.items():
    np.testing.assert_array_equal(ro.features[key], value)
  np.testing.assert_array_equal(ro.mask, weights)
  np.testing.assert_array_equal(ro.has_eos, [True, True, False])
  np.testing.assert_allclose(ro.raw_scores, expected_raw, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(ro.scores, [expected_raw[0], expected_raw[1],
                                         -1.0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ro_no_trick.scores, expected_raw, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(ro.logprobs, expected_lp, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ro.ref_logprobs, expected_ref, rtol=1e-5,
                             atol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, ro, ro_junk)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def _saved_state(workdir, step):
  return checkpoint_files.restore_state_as_numpy(
      os.path.join(workdir, "checkpoints", str(step), "state"))


def test_adaptive_kl_state_is_checkpointed_and_resume_is_bit_exact(
    workdirs, tmp_path, monkeypatch):
  """Two steps, stop, two more == four steps straight, through the shared
  loop; the adaptive KL coefficient follows Ziegler et al.'s rule."""
  target, horizon, batch = 0.01, 32, 8
  config = _config(workdirs, online__adaptive_kl=True,
                   online__kl_target=target, online__kl_horizon=horizon,
                   online__num_epochs=2, online__num_minibatches=2,
                   train__batch_size=batch, train__num_steps=4,
                   checkpoint__every_steps=2, optimizer__name="adamw",
                   optimizer__learning_rate=3e-3)
  # Evaluation is not what is tested here.
  unevaluated = dataclasses.replace(
      algorithms.get("ppo"), evaluation=base.Evaluation(
          evaluate=lambda trainer, state: {}, describe=lambda trainer: ""))
  monkeypatch.setattr(
      algorithms, "build",
      lambda c, mesh, workdir=None: algorithms.trainer.Trainer(
          unevaluated, c, mesh, workdir))
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  loop.train(config, str(straight))
  first = config.copy_and_resolve_references()
  first.train.num_steps = 2
  loop.train(first, str(resumed))
  assert sorted(_metrics(resumed)) == [1, 2]
  loop.train(config, str(resumed))

  expected, got = _metrics(straight), _metrics(resumed)
  assert sorted(expected) == [1, 2, 3, 4]
  assert got == expected
  a, b = _saved_state(straight, 4), _saved_state(resumed, 4)
  jax.tree.map(np.testing.assert_array_equal, a["params"], b["params"])
  jax.tree.map(np.testing.assert_array_equal, a["opt_state"], b["opt_state"])
  np.testing.assert_array_equal(a["algorithm_state"]["kl_coef"],
                                b["algorithm_state"]["kl_coef"])

  # beta <- beta (1 + clip((KL - target) / target, +-0.2) n / horizon), n =
  # responses per step; the logged coefficient is the one the step used.
  beta = config.online.kl_coef
  for step in range(1, 5):
    np.testing.assert_allclose(expected[step]["kl_coef"], beta, rtol=1e-5)
    error = np.clip((expected[step]["kl"] - target) / target, -0.2, 0.2)
    beta = beta * (1 + error * batch / horizon)
  np.testing.assert_allclose(float(a["algorithm_state"]["kl_coef"]), beta,
                             rtol=1e-5)
  assert abs(beta - config.online.kl_coef) > 1e-3


def test_fit_prompt_drops_trailing_paragraphs():
  encode = lambda text: text.split() + ["</s>"]
  text = "SUBREDDIT: r/x\n\nPOST: one two\nthree four five\nsix seven\n\nTL;DR:"
  # Fits: unchanged.
  assert prompts_lib.fit_prompt(text, encode, 100) == (encode(text), 0)
  # Keeping "\n\nTL;DR:", the post loses "six seven", then "three four five".
  tokens, cuts = prompts_lib.fit_prompt(text, encode, 9, suffix="\n\nTL;DR:")
  assert tokens == encode("SUBREDDIT: r/x\n\nPOST: one two\n\nTL;DR:")
  assert cuts == 2
  tokens, cuts = prompts_lib.fit_prompt(text, encode, 11, suffix="\n\nTL;DR:")
  assert tokens == encode(
      "SUBREDDIT: r/x\n\nPOST: one two\nthree four five\n\nTL;DR:")
  assert cuts == 1
  # No suffix: cut at the last newline of the whole text.
  tokens, _ = prompts_lib.fit_prompt(text, encode, 10)
  assert tokens == encode("SUBREDDIT: r/x\n\nPOST: one two\nthree four five")
  with pytest.raises(prompts_lib.PromptTooLongError, match="no paragraph break"):
    prompts_lib.fit_prompt("a b c d e f", encode, 3)
  with pytest.raises(prompts_lib.PromptTooLongError, match="more than 3"):
    prompts_lib.fit_prompt(text, encode, 3, on_long="raise")


@pytest.fixture
def paragraph_task():
  name = "online_test_paragraph_prompts"
  texts = ["summarize: red blue",
           "summarize: red blue\nfox owl\ncat dog sun moon star",
           "summarize: red blue green gold cat dog fox owl sun moon"]
  vocabulary = tasks.synthetic_vocabulary()

  def register(rows):
    if name in seqio.TaskRegistry.names():
      seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name, source=seqio.FunctionDataSource(
            lambda split, shuffle_files, seed=None:
            tf.data.Dataset.from_tensor_slices(
                {"inputs": [texts[i] for i in rows],
                 "targets": ["red"] * len(rows)}),
            splits=("train",)),
        preprocessors=[seqio.preprocessors.tokenize,
                       seqio.preprocessors.append_eos_after_trim],
        output_features={
            "inputs": seqio.Feature(vocabulary, add_eos=True),
            "targets": seqio.Feature(vocabulary, add_eos=True)})
  encode = lambda text: list(vocabulary.encode(text)) + [vocabulary.eos_id]
  yield name, register, encode
  seqio.TaskRegistry.remove(name)


def test_long_prompts_are_cut_at_paragraphs_or_rejected_by_row(
    paragraph_task):
  name, register, encode = paragraph_task
  kept = encode("summarize: red blue\nfox owl")
  limit = len(kept)
  assert len(encode("summarize: red blue\nfox owl\ncat dog sun moon star")
             ) > limit
  config = tiny_config(algorithm="ppo", data__task=name,
                       data__inputs_length=limit)
  load = lambda: prompts_lib.load_prompts(
      name, "train", limit, on_long=config.online.long_prompts)
  register([0, 1])
  prompts = load()
  assert prompts.num_cut == 1
  np.testing.assert_array_equal(
      prompts.tokens[0], np.pad(encode("summarize: red blue"),
                                (0, limit - len(encode("summarize: red blue")))))
  np.testing.assert_array_equal(prompts.tokens[1], kept)

  register([0, 1, 2])  # row 2 has no paragraph break to cut at
  with pytest.raises(ValueError, match=rf"{name}.*'train', row 2 .*no "
                     "paragraph break"):
    load()
  config.online.long_prompts = "raise"
  with pytest.raises(ValueError, match=r"row 1 .*more than .*long_prompts="
                     "'cut_paragraph'"):
    load()


def test_prompt_batches_reshuffle_every_pass_without_replacement():
  prompts = np.arange(10)[:, None]
  batches = prompts_lib.PromptBatches(prompts, global_batch_size=4, seed=3)
  served = np.concatenate([next(batches)["encoder_input_tokens"][:, 0]
                           for _ in range(10)])  # 40 = four passes
  passes = served.reshape(4, 10)
  for p in passes:
    assert sorted(p) == list(range(10))  # each prompt once per pass
  assert len({tuple(p) for p in passes}) == 4  # a new order every pass
  assert batches.position == 10
  resumed = prompts_lib.PromptBatches(prompts, global_batch_size=4, seed=3,
                                 position=7)
  np.testing.assert_array_equal(next(resumed)["encoder_input_tokens"][:, 0],
                                served[28:32])
  other_seed = prompts_lib.PromptBatches(prompts, global_batch_size=4, seed=4)
  assert not np.array_equal(next(other_seed)["encoder_input_tokens"][:, 0],
                            served[:4])


def test_reward_model_with_another_vocabulary_fails_at_start_up(workdirs,
                                                                tmp_path):
  other = vocab.word_vocabulary(["alpha", "beta", "gamma"])
  rm = tmp_path / "rm_other_vocabulary"
  shutil.copytree(workdirs["rm"], rm)
  run = json.loads((rm / "config.json").read_text())
  run["data"]["files"]["vocabulary"] = other.sentencepiece_model_file
  (rm / "config.json").write_text(json.dumps(run))
  config = _config(workdirs, online__reward_model_checkpoint=str(rm))
  policy_vocabulary = vocab.describe(tasks.synthetic_vocabulary())
  with _mesh_context(config) as mesh:
    with pytest.raises(ValueError) as error:
      algorithms.build(config, mesh)
  message = str(error.value)
  assert "config.online.reward_model_checkpoint" in message
  assert vocab.describe(other) in message
  assert policy_vocabulary in message and str(rm) in message


def test_missing_reward_model_is_a_config_error(workdirs):
  config = _config(workdirs, online__reward_model_checkpoint="")
  with pytest.raises(ValueError, match="config.online.reward_model_checkpoint"):
    defaults.validate(config)
  with _mesh_context(config) as mesh:
    with pytest.raises(ValueError, match="reward_model_checkpoint"):
      algorithms.build(config, mesh)


@pytest.mark.parametrize("selection,top_k", [("top_per_prompt", None),
                                             ("top_k_overall", 5)])
def test_rejection_sampling_keeps_the_best_rows(workdirs, selection, top_k):
  config = _config(workdirs, algorithm="rejection_sampling",
                   online__samples_per_prompt=3,
                   rejection_sampling__selection=selection,
                   rejection_sampling__top_k=top_k)
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(8, 3)).astype(np.float32)
  with _mesh_context(config) as mesh:
    trainer = algorithms.build(config, mesh)
    rows = np.asarray(rejection_sampling.selected_rows(
        trainer.config, jnp.asarray(scores.reshape(-1)),
        trainer.online.samples_per_prompt))
  flat = scores.reshape(-1)
  if selection == "top_per_prompt":
    expected = [3 * i + int(np.argmax(scores[i])) for i in range(8)]
    np.testing.assert_array_equal(rows, expected)
  else:
    np.testing.assert_array_equal(sorted(rows),
                                  sorted(np.argsort(-flat)[:5]))


def test_bad_online_configs_name_the_field(workdirs):
  for overrides, field in (
      ({"algorithm": "rloo", "online__samples_per_prompt": 1},
       "online.samples_per_prompt"),
      ({"model__dropout_rate": 0.1}, "model.dropout_rate"),
      ({"online__kl_estimator": "k4"}, "online.kl_estimator"),
      ({"online__long_prompts": "truncate"}, "online.long_prompts")):
    with pytest.raises(ValueError, match=f"config.{field}"):
      defaults.validate(_config(workdirs, **overrides))
  config = _config(workdirs, online__num_minibatches=3)
  with _mesh_context(config) as mesh:
    with pytest.raises(ValueError, match="num_minibatches: 8 responses"):
      algorithms.build(config, mesh)
  # 12 responses / 2 minibatches = 6 rows per update: 4 micro-batches cannot
  # split them (though they divide train.batch_size).
  config = _config(workdirs, online__num_minibatches=2,
                   train__num_microbatches=4, train__batch_size=12)
  with _mesh_context(config) as mesh:
    with pytest.raises(ValueError, match="num_microbatches: 4 does not divide "
                       r"each minibatch update of ppo \(6 responses"):
      algorithms.build(config, mesh)
  config = _config(workdirs, online__rollout_microbatches=3)
  with _mesh_context(config) as mesh:
    with pytest.raises(ValueError, match="rollout_microbatches: 8 prompts"):
      algorithms.build(config, mesh)


def test_a_rollout_in_parts_is_its_parts_in_prompt_order(workdirs):
  """online.rollout_microbatches = 2: part p rolls out prompts p, p + 2, ...
  with its own key; the step's rollout is the parts' rows put back so that
  each prompt's k responses are adjacent and in the prompts' order."""
  config = _config(workdirs, algorithm="grpo", online__samples_per_prompt=2,
                   online__rollout_microbatches=2)
  k, parts = 2, 2
  with _mesh_context(config) as mesh:
    trainer = algorithms.build(config, mesh)
    state = trainer.init_state()
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                  trainer.rules)
    prompts = np.asarray(batch["encoder_input_tokens"])
    rng = jax.random.PRNGKey(3)
    whole = jax.jit(lambda s, p: iteration.make_rollout(
        trainer, s.params, s.frozen, p, rng))(state, prompts)
    rngs = jax.random.split(rng, parts)
    # Each part as a rollout of its own prompts, with its own key.
    config.online.rollout_microbatches = 1
    part = [jax.jit(lambda s, p, r: iteration.make_rollout(
        trainer, s.params, s.frozen, p, r))(state, prompts[p::parts], rngs[p])
            for p in range(parts)]
    config.online.rollout_microbatches = parts
  # Each row's prompt, as the policy was fed it: prompt i's k rows at i * k.
  np.testing.assert_array_equal(
      np.asarray(whole.features["encoder_input_tokens"]),
      np.repeat(prompts, k, axis=0))
  for p in range(parts):
    rows = np.concatenate([np.arange(i * k, (i + 1) * k)
                           for i in range(p, len(prompts), parts)])
    for name in ("logprobs", "mask", "scores"):
      np.testing.assert_allclose(np.asarray(getattr(whole, name))[rows],
                                 np.asarray(getattr(part[p], name)),
                                 rtol=1e-5, atol=1e-6, err_msg=name)
  # And a train step on it runs, with finite metrics.
  with _mesh_context(config):
    _, metrics = trainer.train_step(state, batch)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("algorithm,overrides,scored,kept", [
    ("grpo", {"grpo.kl_coef": 0.04}, True, True),
    ("grpo", {"grpo.kl_coef": 0.0}, False, False),
    ("ppo", {"online.kl_coef": 0.05}, True, True),
    ("ppo", {"online.kl_coef": 0.0}, False, False),
    ("rloo", {"online.kl_coef": 0.0}, False, False),
    ("rejection_sampling", {"online.kl_coef": 0.05}, False, True),
    ("rejection_sampling", {"rejection_sampling.sample_from": "policy"},
     False, False)])
def test_the_reference_is_scored_and_kept_only_where_a_step_reads_it(
    algorithm, overrides, scored, kept):
  """A KL coefficient of 0 (or none: rejection sampling) needs no reference
  forward pass; any other value does. The run keeps the reference only when
  a step reads it: to score samples, or to sample from it (rejection
  sampling's default, sample_from='reference')."""
  config = defaults.base_config()
  defaults.apply_overrides(config, {"algorithm": algorithm, **overrides})
  trainer = type("T", (), {"algorithm": algorithms.get(algorithm),
                           "config": config})
  assert kl_control.scores_reference(trainer.algorithm,
                                     trainer.config) is scored
  assert recipe.keeps_reference(trainer.algorithm, trainer.config) is kept


@pytest.mark.parametrize("algorithm,field", [
    ("grpo", "grpo.kl_coef"), ("ppo", "online.kl_coef"),
    ("reinforce", "online.kl_coef")])
def test_an_adaptive_kl_from_0_is_a_config_error_naming_the_field(
    algorithm, field):
  """The controller multiplies the coefficient: started at 0 it would stay
  0, a run with no KL term that asked for one."""
  config = defaults.base_config()
  defaults.apply_overrides(config, {"algorithm": algorithm, field: 0.0,
                                    "online.adaptive_kl": True,
                                    "online.reward_model_checkpoint": "rm"})
  with pytest.raises(ValueError, match=rf"^config\.online\.adaptive_kl: "
                     rf"True with {re.escape(field)} = 0"):
    defaults.validate(config)
  config.online.adaptive_kl = False
  defaults.validate(config)  # 0 without the controller: no KL term, fine


def test_grpo_without_kl_holds_no_reference_and_trains_the_same(
    workdirs, monkeypatch, capsys):
  """grpo.kl_coef = 0: the run holds no reference (no step reads one) and
  its update is, bit for bit, the one of a step that keeps a reference
  unlike the policy, scores the samples under it and weighs their KL by 0;
  only the 'kl' metrics go (they would describe a reference not read). A
  checkpoint written with the reference (by a jaxrlhf that kept it) resumes
  into the run without it, every other value as saved."""
  config = _config(workdirs, algorithm="grpo", grpo__kl_coef=0.0,
                   online__samples_per_prompt=2, online__num_epochs=2)
  steps, trainers = {}, {}
  for scored in (True, False):
    if scored:
      monkeypatch.setattr(kl_control, "scores_reference",
                          lambda algorithm, config: True)
    else:
      monkeypatch.undo()
    with _mesh_context(config) as mesh:
      trainer = algorithms.build(config, mesh)
      state = trainer.init_state()
      batch = sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                    trainer.rules)
      if scored:
        # A reference unlike the policy, so that its KL is not 0.
        state = state.replace(frozen=dict(
            state.frozen, reference=jax.tree.map(
                lambda p: p * 1.5, state.frozen["reference"])))
      else:
        assert "reference" not in state.frozen
      trainers[scored] = trainer
      steps[scored] = trainer.train_step(jax.tree.map(jnp.copy, state), batch)
  skipped, metrics = steps[False]
  scored_state, scored_metrics = steps[True]
  assert float(scored_metrics["kl"]) > 1e-3  # the reference is not the policy
  assert "kl" not in metrics and "loss_kl_k3" not in metrics
  assert "loss_kl_k3" in scored_metrics
  # Exactly: the terms skipped were zeros (0 x a finite KL), so a run with
  # kl_coef 0 trains as it did when the reference was scored.
  jax.tree.map(np.testing.assert_array_equal, skipped.params,
               scored_state.params)
  assert float(metrics["loss"]) == float(scored_metrics["loss"])

  # The state with the reference, saved, restores into the run without it.
  checkpointer = checkpointing.Checkpointer(
      str(workdirs["root"] / "with_reference" / "checkpoints"), keep=2)
  checkpointer.save(3, scored_state, 7)
  capsys.readouterr()
  with _mesh_context(config):
    step, restored, position = checkpointer.restore_latest(
        trainers[False].checkpoint_target())
  checkpointer.close()
  assert (step, position) == (3, 7)
  assert "reference" not in restored.frozen
  for part in ("params", "opt_state", "algorithm_state"):
    jax.tree.map(np.testing.assert_array_equal, getattr(restored, part),
                 getattr(scored_state, part))
  assert ("holds frozen networks this run no longer keeps "
          "(frozen/reference)") in capsys.readouterr().out

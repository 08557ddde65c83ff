"""Online RL with decoder-only policies, and micro-batched online updates.

Checked against independent computations: the rollout's log-probs, values
and rewards of left-padded prompts against each row run alone, unpadded,
through the networks (plain numpy on their outputs); the value of response
token t read at the state before it ("N+ implementation details", detail
22 / the reference code's `values[:, context_length - 1:-1]`); the in-jit
left padding against the rows padded by hand; and an
update accumulated over micro-batches against the same update on the whole
minibatch. Networks are tiny and random, written into workdirs by hand.
"""

import functools
import json
import os

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxrlhf import algorithms
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import ppo
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.algorithms import update as update_lib
from jaxrlhf import checkpoint_files
from jaxrlhf.data import tasks
from jaxrlhf.models.registry import build_model
from jaxrlhf.models import heads
from jaxrlhf.models import sampling
from jaxrlhf.models import scoring
from jaxrlhf.rl import rollout as rollout_lib
from jaxrlhf import sharding
from jaxrlhf.train import checkpointing
from jaxrlhf.train import loop

EOS = 1
MAX_NEW = 8


def _arch_overrides(arch):
  if arch == "t5":
    return {}
  return {"model__arch": arch, "model__size": "tiny",
          "model__num_encoder_layers": None}


def _mesh_context(config):
  return sharding.activate(config, jax.devices()[:1])


def _init_lm_params(config, seed):
  """Random params of config.model, initialised as the trainer does."""
  module, model_config = build_model(
      config.model, tasks.synthetic_vocabulary().vocab_size)
  rng = jax.random.PRNGKey(seed)
  lp, lt = config.data.inputs_length, config.data.targets_length
  init = jax.jit(module.init)
  if scoring.adapter_for(module).is_encoder_decoder:
    params = init(rng, jnp.ones((1, lp), jnp.int32),
                  jnp.ones((1, lt), jnp.int32),
                  jnp.ones((1, lt), jnp.int32))["params"]
  else:
    tokens = jnp.ones((1, lp + lt), jnp.int32)
    params = init(rng, tokens, jnp.arange(lp + lt)[None], tokens)["params"]
  return nn.unbox(params), model_config


def _write_workdir(path, config, params):
  if params is None:  # only the run config (architecture, vocabulary)
    loop.prepare_workdir(str(path), config)
    return
  state = state_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state={}, frozen={},
      rng=jax.random.PRNGKey(0), algorithm_state={})
  loop.prepare_workdir(str(path), config)
  ckpt = checkpointing.Checkpointer(os.path.join(path, "checkpoints"), keep=1)
  ckpt.save(1, state, 0)
  ckpt.close()


def _make_workdirs(root, policy_arch, reward_arch, checkpoints=True):
  """A random "SFT" policy and a random reward model (own backbone); with
  `checkpoints` False only their run configs (for runs that start from
  random networks: the reward model's architecture comes from its run)."""
  policy_config = tiny_config(algorithm="sft", **_arch_overrides(policy_arch))
  reward_config = tiny_config(algorithm="reward_model",
                              **_arch_overrides(reward_arch))
  policy = reward = None
  if checkpoints:
    policy, _ = _init_lm_params(policy_config, 1)
    backbone, model_config = _init_lm_params(reward_config, 2)
    reward = nn.unbox(heads.init_from_backbone(
        jax.random.PRNGKey(3), backbone, model_config.emb_dim))
    # A bias far from 0 makes a misplaced read of the head visible.
    reward["head"]["bias"] = np.float32(0.5)
  _write_workdir(root / "sft", policy_config,
                 None if policy is None else {"policy": policy})
  _write_workdir(root / "rm", reward_config,
                 None if reward is None else {"reward": reward})
  return {"sft": str(root / "sft"), "rm": str(root / "rm"),
          "policy": policy, "arch": policy_arch}


@pytest.fixture(scope="module")
def llama_workdirs(tmp_path_factory):
  return _make_workdirs(tmp_path_factory.mktemp("llama"), "llama", "llama")


@pytest.fixture(scope="module")
def t5_workdirs(tmp_path_factory):
  return _make_workdirs(tmp_path_factory.mktemp("t5"), "t5", "t5",
                        checkpoints=False)


def _config(workdirs, algorithm="ppo", **overrides):
  base = dict(algorithm=algorithm, init__policy_checkpoint=workdirs["sft"],
              online__reward_model_checkpoint=workdirs["rm"],
              online__max_new_tokens=MAX_NEW, optimizer__warmup_steps=0,
              train__batch_size=4, **_arch_overrides(workdirs["arch"]))
  base.update(overrides)
  return tiny_config(**base)


# Encoder-style prompts (right-padded, ending in EOS) of different lengths,
# one filling all 16 columns; responses ending at different places, one
# without EOS.
PROMPTS = [[5, 6, 7, EOS], [9, 10, 11, 12, 13, 14, 15, 16, 17, EOS],
           list(range(20, 35)) + [EOS], [40, EOS]]
RESPONSES = [[3, 4, EOS], [8, 9, 10, 11, 12, 13, 14, 15],
             [EOS], [6, 7, 8, 9, 10, EOS]]


def _padded(rows, width, fill=0):
  out = np.full((len(rows), width), fill, np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def _right_padded_outputs(module, params, sequences, method=None):
  """The network's outputs on sequences laid out as SFT and reward-model
  training lay them out (right-padded, positions 0, 1, ... from the first
  token): row i's first len(sequences[i]) outputs equal those of the row
  alone, since causal attention never reads the padding after it."""
  width = max(map(len, sequences))
  tokens = _padded(sequences, width)
  mask = _padded([[1] * len(q) for q in sequences], width)
  positions = np.tile(np.arange(width, dtype=np.int32), (len(sequences), 1))
  apply = jax.jit(functools.partial(
      module.apply, **({} if method is None else {"method": method})))
  out = np.asarray(apply({"params": params}, tokens, positions, mask),
                   np.float64)
  return [out[i, :len(q)] for i, q in enumerate(sequences)]


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_in_jit_left_padding_matches_the_host_version():
  # Empty; only an EOS; EOS-terminated; no EOS; full width with EOS; random.
  rows = [[], [EOS], [7, 8, EOS], [4, 5, 6], [9] * 8 + [EOS]]
  rng = np.random.default_rng(0)
  rows += [list(rng.integers(2, 50, n)) + [EOS] for n in (1, 4, 8)]
  prompts = _padded(rows, 9)
  # By hand: the real tokens without a trailing EOS, moved to the right end.
  want_tokens = np.zeros_like(prompts)
  for i, row in enumerate(rows):
    real = [int(t) for t in row]
    if real and real[-1] == EOS:
      real = real[:-1]
    if real:
      want_tokens[i, -len(real):] = real
  want_mask = (want_tokens > 0).astype(np.int32)
  tokens, mask = jax.jit(rollout_lib.left_pad_prompts)(prompts)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_array_equal(mask, want_mask)
  np.testing.assert_array_equal(np.asarray(tokens)[2], [0] * 7 + [7, 8])
  np.testing.assert_array_equal(np.asarray(mask)[3], [0] * 6 + [1] * 3)


def test_decoder_only_rollout_is_left_padding_invariant_and_values_are_shifted(
    llama_workdirs):
  """Log-probs, reward and values of each row of a left-padded batch equal
  those of the row alone without padding, with V(s_t) read at the position
  before response token t and the reward at the EOS."""
  config = _config(llama_workdirs)
  temperature = config.online.temperature
  prompts = jnp.asarray(_padded(PROMPTS, config.data.inputs_length))
  responses = _padded(RESPONSES, MAX_NEW, fill=EOS)
  responses[2, 1:] = [4, 5, 6, 7, 8, 9, 10]  # sampled on after its EOS
  with _mesh_context(config) as mesh:
    trainer = algorithms.build(config, mesh)
    reward_lm = trainer.online.rewards.lm
    assert not trainer.lm.is_encoder_decoder
    assert not reward_lm.is_encoder_decoder
    state = trainer.init_state()
    # Detail 22: the value network starts as the (decoder-only) reward model.
    jax.tree.map(np.testing.assert_array_equal, state.params["value"],
                 state.frozen["reward"])
    assemble = jax.jit(lambda s, r: rollout_lib.assemble_rollout(
        trainer.lm, s.params["policy"], s.frozen["reference"],
        reward_lm, s.frozen["reward"], prompts, r,
        temperature=temperature, eos_id=EOS, missing_eos_penalty=-1.0))
    ro = assemble(state, jnp.asarray(responses))
    eval_scores = reward_sources.reward_scores(
        trainer, state.frozen["reward"], np.asarray(prompts), sampling.Samples(
            tokens=np.asarray(ro.features["tokens"])[:, -MAX_NEW:],
            logprobs=np.asarray(ro.logprobs), mask=np.asarray(ro.mask),
            has_eos=np.asarray(ro.has_eos)))
    targets = jax.jit(lambda v, r, k: ppo.rollout_targets(
        trainer.config, trainer.online.rewards.lm, v, r, k))(
        state.params["value"], ro, jnp.float32(0.05))
    policy, value = state.params["policy"], state.params["value"]
    reward = state.frozen["reward"]
    policy_module, value_module = trainer.model, reward_lm.module
    hidden = value_module.hidden_states
    prompts_alone = [p[:-1] for p in PROMPTS]  # no EOS before the response
    responses_alone = [r[:r.index(EOS) + 1] if EOS in r else r
                       for r in RESPONSES]
    sequences = [p + r for p, r in zip(prompts_alone, responses_alone)]
    logits = _right_padded_outputs(policy_module, policy, sequences)
    v_states = _right_padded_outputs(value_module, value["backbone"],
                                     sequences, hidden)
    r_states = _right_padded_outputs(value_module, reward["backbone"],
                                     sequences, hidden)
    rows = [(p, r, l / temperature, v, rs) for p, r, l, v, rs in zip(
        prompts_alone, responses_alone, logits, v_states, r_states)]

  mask = np.asarray(ro.mask)
  assert ro.logprobs.shape == ro.mask.shape == (4, MAX_NEW)
  head = lambda net, h: h @ np.asarray(net["head"]["kernel"],
                                       np.float64) + float(net["head"]["bias"])
  for b, (p, r, logits, v_states, r_states) in enumerate(rows):
    n = len(r)
    np.testing.assert_array_equal(mask[b], [1] * n + [0] * (MAX_NEW - n))
    logp = _log_softmax(logits)
    # Token t of the response sits at len(p) + t; the logits before it
    # predict it, and the value head reads that same state.
    want_lp = [logp[len(p) + t - 1, r[t]] for t in range(n)]
    want_values = [head(value, v_states[len(p) + t - 1]) for t in range(n)]
    np.testing.assert_allclose(ro.logprobs[b, :n], want_lp, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(targets["old_values"][b, :n], want_values,
                               rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(ro.logprobs)[b, n:] == 0)
    assert np.all(np.asarray(targets["old_values"])[b, n:] == 0)
    # The reference starts as the policy (both from the SFT checkpoint).
    np.testing.assert_allclose(ro.ref_logprobs[b, :n], want_lp, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(ro.raw_scores[b], head(reward, r_states[-1]),
                               rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ro.has_eos, [True, False, True, True])
  np.testing.assert_allclose(ro.scores[1], -1.0)  # the EOS trick
  # Evaluation's proxy reward scores the same completions the same way.
  np.testing.assert_allclose(eval_scores, ro.scores, rtol=1e-5, atol=1e-5)
  # The shift matters: reading the value at each token's own position
  # instead gives different numbers.
  p, r, _, v_states, _ = rows[0]
  unshifted = [head(value, v_states[len(p) + t]) for t in range(len(r))]
  assert np.abs(np.asarray(targets["old_values"])[0, :len(r)]
                - unshifted).max() > 1e-3


def test_t5_reward_model_scores_a_decoder_only_policy(llama_workdirs,
                                                      t5_workdirs):
  """The reward model's architecture is its own run's: a T5 RM scores a
  Llama policy's responses from encoder-decoder features."""
  config = _config(llama_workdirs, algorithm="rloo",
                   online__reward_model_checkpoint=t5_workdirs["rm"])
  prompts = jnp.asarray(_padded(PROMPTS, config.data.inputs_length))
  responses = jnp.asarray(_padded(RESPONSES, MAX_NEW))
  with _mesh_context(config) as mesh:
    trainer = algorithms.build(config, mesh)
    reward_lm = trainer.online.rewards.lm
    assert reward_lm.is_encoder_decoder
    state = trainer._init(jax.random.PRNGKey(0))  # pylint: disable=protected-access
    ro = jax.jit(lambda s: rollout_lib.assemble_rollout(
        trainer.lm, s.params["policy"], s.frozen["reference"],
        reward_lm, s.frozen["reward"], prompts, responses,
        temperature=1.0, eos_id=EOS, missing_eos_penalty=None))(state)
    reward = state.frozen["reward"]
    module = reward_lm.module
    # T5 reads the prompt with its EOS; the decoder reads BOS + r[:-1].
    cut = [r[:r.index(EOS) + 1] if EOS in r else r for r in RESPONSES]
    states = jax.jit(functools.partial(
        module.apply, deterministic=True, return_hidden=True))(
            {"params": reward["backbone"]}, _padded(PROMPTS, 16),
            _padded([[0] + r[:-1] for r in cut], MAX_NEW), _padded(cut, MAX_NEW))
    last = np.asarray(states)[np.arange(4), [len(r) - 1 for r in cut]]
    want = last @ np.asarray(reward["head"]["kernel"]) + float(
        reward["head"]["bias"])
  assert "tokens" in ro.features and "encoder_input_tokens" not in ro.features
  assert "encoder_input_tokens" in ro.reward_features
  np.testing.assert_allclose(ro.raw_scores, want, rtol=1e-5, atol=1e-5)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if "loss" in r]


@pytest.mark.parametrize("algorithm", ["ppo", "rloo", "grpo", "reinforce",
                                       "rejection_sampling"])
def test_decoder_only_online_algorithms_train_end_to_end(
    llama_workdirs, tmp_path, monkeypatch, algorithm):
  """Two RL iterations through the shared loop: sampling from a Llama
  policy, a Llama reward model, updates; losses finite, weights moved."""
  config = _config(llama_workdirs, algorithm=algorithm, train__num_steps=2,
                   train__batch_size=2, online__samples_per_prompt=2,
                   online__num_epochs=1, optimizer__name="adamw",
                   optimizer__learning_rate=1e-2,
                   # A random policy rarely ends within 8 tokens: with the
                   # EOS trick every score would be -1 and the group
                   # advantages 0.
                   online__eos_trick=False)
  # Evaluation's decoder-only sampling is the offline algorithms' (tested
  # there); its reward-model scores are checked in the rollout test.
  unevaluated = dataclasses.replace(
      algorithms.get(algorithm), evaluation=base.Evaluation(
          evaluate=lambda trainer, state: {}, describe=lambda trainer: ""))
  monkeypatch.setattr(
      algorithms, "build",
      lambda c, mesh, workdir=None: algorithms.trainer.Trainer(
          unevaluated, c, mesh, workdir))
  workdir = str(tmp_path / algorithm)
  loop.train(config, workdir)
  rows = _metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  for row in rows:
    assert np.isfinite(row["loss"])
    assert 0 < row["response_length"] <= MAX_NEW
    assert np.isfinite(row["score"])
  saved = checkpoint_files.restore_state_as_numpy(
      os.path.join(workdir, "checkpoints", "2", "state"))
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                       saved["params"]["policy"], llama_workdirs["policy"])
  assert max(jax.tree.leaves(moved)) > 1e-4


def _update_with_microbatches(algorithm, workdirs, micro, state=None,
                              **overrides):
  # Plain SGD without clipping, so that an update is -lr * gradient: a
  # gradient scaled by a wrong micro-batch weight shows (Adam-style
  # optimizers would hide a constant factor).
  config = _config(workdirs, algorithm=algorithm, train__batch_size=8,
                   train__num_microbatches=micro, online__num_minibatches=2,
                   optimizer__name="sgd", optimizer__learning_rate=0.1,
                   optimizer__grad_clip_norm=0.0, **overrides)
  # Responses of 1 to 8 tokens, so micro-batches hold different numbers of
  # tokens and a token mean is not a mean of micro-batch means.
  lengths = [1, 8, 2, 8, 3, 1, 8, 5]
  samples = config.online.samples_per_prompt or 1
  rows = 4 * samples
  prompts = np.repeat(_padded(PROMPTS, config.data.inputs_length), samples,
                      axis=0)[:rows]
  responses = np.full((rows, MAX_NEW), 7, np.int32)
  for i in range(rows):
    n = lengths[i % len(lengths)]
    responses[i, :n] = np.arange(10, 10 + n)
    if n < MAX_NEW:
      responses[i, n - 1] = EOS
  with _mesh_context(config) as mesh:
    trainer = algorithms.build(config, mesh)
    if state is None:
      # Random networks (no checkpoints to read): the comparison only needs
      # the same start for both runs.
      state = trainer._init(jax.random.PRNGKey(0))  # pylint: disable=protected-access
      # The reference starts as the policy, as from an SFT checkpoint (a
      # random reference far from the policy makes GRPO's k3 term explode).
      state = state.replace(frozen=dict(
          state.frozen, reference=jax.tree.map(jnp.copy,
                                               state.params["policy"])))
    ro = jax.jit(lambda s: rollout_lib.assemble_rollout(
        trainer.lm, s.params["policy"], s.frozen["reference"],
        trainer.online.rewards.lm, s.frozen["reward"], jnp.asarray(prompts),
        jnp.asarray(responses), temperature=config.online.temperature,
        eos_id=EOS))(state)
    rng = jax.random.PRNGKey(5)

    def advantages_then_updates(s, r, k):
      rows, carried, _ = iteration.advantages(trainer, s, r)
      s, metrics = iteration.update(trainer, s, rows, carried, k, k)
      return s.params, metrics
    params, metrics = jax.jit(advantages_then_updates)(state, ro, rng)
  # The micro-batches of the first update hold different token counts (else
  # the weighting would not be tested).
  first = rollout_lib.minibatch_indices(rng, rows, trainer.online.num_epochs,
                                        2)[0]
  tokens = np.asarray(ro.mask).sum(-1)[np.asarray(first)]
  micro_tokens = np.asarray(update_lib.split_microbatches(tokens, 2)).sum(-1)
  assert micro_tokens[0] != micro_tokens[1]
  return state, params, metrics


@pytest.mark.parametrize("algorithm,arch,overrides", [
    ("ppo", "t5", {}),
    ("grpo", "llama", {"grpo__reduction": "sequence_mean",
                       "online__samples_per_prompt": 2}),
])
def test_microbatched_update_equals_the_whole_minibatch_update(
    request, algorithm, arch, overrides):
  workdirs = request.getfixturevalue(f"{arch}_workdirs")
  start, whole, whole_metrics = _update_with_microbatches(
      algorithm, workdirs, 1, online__num_epochs=2, **overrides)
  _, split, split_metrics = _update_with_microbatches(
      algorithm, workdirs, 2, start, online__num_epochs=2, **overrides)
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), whole,
                       start.params)
  assert max(jax.tree.leaves(moved)) > 1e-4  # the updates did something
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               split, whole)
  # Token-mean metrics are exact where the loss is a token mean (PPO); with
  # a per-response loss they become response-weighted means.
  keys = ["loss", "policy_loss"]
  if algorithm == "ppo":
    keys += ["value_loss", "clip_fraction", "ratio_mean"]
  for key in keys:
    np.testing.assert_allclose(split_metrics[key], whole_metrics[key],
                               rtol=1e-4, atol=1e-6)

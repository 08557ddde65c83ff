"""Reward modelling: Bradley-Terry on preference pairs (optional margin,
reward centring, and every prompt weighted once) and, on K-wise rankings,
Plackett-Luce or Bradley-Terry over all pairs (jaxrlhf.losses.reward_model).

The reward model is a copy of the policy backbone (`init.policy_checkpoint`)
with a scalar head read at the completion's EOS (jaxrlhf.models.heads).

With `reward_model.normalize_on_task` set, the end of training
(`finish_training`) shifts the head's bias so that the reference
completions (the task's `targets`) score mean 0 ("N+ implementation details
of RLHF with PPO", detail 15); the loop then saves that state as the final
checkpoint through its usual atomic save, so PPO and the other online
recipes that read this run get normalised rewards. The mean before and after is logged with the
last step's metrics (`reward_normalization/...`).
"""

from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import seqio
import tensorflow as tf

from jaxrlhf import sharding
from jaxrlhf.data import alignment_data
from jaxrlhf.data import pipeline
from jaxrlhf.data import vocab
from jaxrlhf.eval import evaluation
from jaxrlhf.losses import reward_model as rm_losses
from jaxrlhf.models import heads
from jaxrlhf.models import scoring
from jaxrlhf.recipes import base
from jaxrlhf.train import metrics as metrics_lib


class RewardModelRecipe(base.Recipe):
  data_kind = "pairs"

  def __init__(self, config, mesh):
    super().__init__(config, mesh)
    self._reference = None
    if config.reward_model.normalize_on_task:
      self._check_normalize_task()

  def init_trainable(self, rng):
    a, b = jax.random.split(rng)
    return {"reward": heads.init_from_backbone(a, self.init_lm(b),
                                               self.model_config.emb_dim)}

  def pretrained_paths(self):
    return {"params/reward/backbone": self.config.init.policy_checkpoint}

  def pair_rewards(self, reward_params, batch):
    """(chosen rewards [batch], rejected rewards [batch]), one forward pass."""
    joined = scoring.concatenate_completions(self.lm, batch,
                                             ("chosen", "rejected"))
    rewards = heads.sequence_rewards(self.lm, reward_params, joined, "joined")
    return jnp.split(rewards, 2)

  def loss(self, params, frozen, batch, rng):
    cfg = self.config.reward_model
    chosen, rejected = self.pair_rewards(params["reward"], batch)
    margin = batch["margin"] if cfg.use_margin and "margin" in batch else None
    # The file sources' per-pair prompt weights average 1 over the data, so
    # the weighted batch mean estimates the mean over prompts of each
    # prompt's mean pair loss (InstructGPT; RLHF book eq. 6).
    weights = (batch.get("prompt_weight") if cfg.weight_prompts_equally
               else None)
    return rm_losses.bradley_terry_loss(chosen, rejected, margin=margin,
                                        weights=weights,
                                        centering_coef=cfg.centering_coef)

  def eval_rewards(self, state, reward_fn):
    """reward_fn(reward params, batch) over the eval split's first
    `eval.num_examples` examples: (this process's rewards as numpy arrays
    [n, ...], their features), or None when the task has no such split."""
    cfg = self.config
    if not hasattr(self, "_eval_features"):
      try:
        features, _ = pipeline.eval_examples(
            cfg.data.task, cfg.data.eval_split, self.feature_lengths,
            self.feature_converter, cfg.eval.num_examples)
      except (ValueError, KeyError, StopIteration):
        features = None
      self._eval_features = features
      self._eval_reward_fn = jax.jit(reward_fn)
    if self._eval_features is None:
      return None
    n = len(next(iter(self._eval_features.values())))
    outputs = [jax.tree.map(evaluation.local_rows,
                            self._eval_reward_fn(state.params["reward"], b))
               for b in evaluation.global_batches(
                   self._eval_features, cfg.eval.batch_size, self.mesh,
                   self.rules)]
    rewards = jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *outputs)
    return rewards, self._eval_features

  def evaluation_description(self) -> str:
    return (f"the first {self.config.eval.num_examples} examples of split "
            f"{self.config.data.eval_split!r}")

  def evaluate(self, state) -> Dict[str, float]:
    """Accuracy, loss and calibration on the eval split's pairs."""
    evaluated = self.eval_rewards(state, self.pair_rewards)
    if evaluated is None:
      return {}
    chosen, rejected = (jnp.asarray(r) for r in evaluated[0])
    _, m = rm_losses.bradley_terry_loss(chosen, rejected)
    table = rm_losses.calibration_table(chosen, rejected, num_bins=5)
    return {"eval/accuracy": float(m["accuracy"]),
            "eval/loss": float(m["bt_loss"]),
            "eval/margin": float(m["margin"]),
            "eval/expected_calibration_error":
                float(table["expected_calibration_error"])}

  # --- reward normalisation (PPO details, detail 15) -----------------------------

  def _check_normalize_task(self):
    """Fails at start-up, naming the field, if the task cannot be scored."""
    rm = self.config.reward_model
    name = rm.normalize_on_task
    field = "config.reward_model.normalize_on_task"
    if name not in seqio.TaskRegistry.names() and (
        name not in seqio.MixtureRegistry.names()):
      raise ValueError(
          f"{field}: no seqio task or mixture named {name!r} is registered. "
          "Use the SFT task whose targets are the reference completions "
          "(e.g. 'synthetic_summarize'), register it first or list its "
          "module in config.data.task_modules, or set it to '' to skip "
          "reward normalisation.")
    features = seqio.get_mixture_or_task(name).output_features
    missing = [k for k in ("inputs", "targets") if k not in features]
    if missing:
      raise ValueError(
          f"{field}: task {name!r} has no {missing} feature(s) (it has "
          f"{sorted(features)}); reward normalisation scores each prompt "
          "('inputs') with its reference completion ('targets'), as an SFT "
          "task holds them.")
    vocabulary = features["targets"].vocabulary
    if vocab.fingerprint(vocabulary) != vocab.fingerprint(self.vocabulary):
      raise ValueError(
          f"{field}: task {name!r} uses vocabulary "
          f"{vocab.describe(vocabulary)}, but the reward model "
          f"reads {vocab.describe(self.vocabulary)}; its scores "
          "of the other vocabulary's token ids would be meaningless. Use a "
          "task with the reward model's vocabulary.")

  def reference_features(self) -> Dict[str, np.ndarray]:
    """This process's share of the normalisation task's (prompt, reference
    completion) pairs, as features of one completion named "completion"
    ([n, ...] numpy arrays, the task's order); read once."""
    if self._reference is not None:
      return self._reference
    cfg = self.config
    rm = cfg.reward_model
    task = seqio.get_mixture_or_task(rm.normalize_on_task)
    shard = seqio.ShardInfo(index=jax.process_index(),
                            num_shards=jax.process_count())
    try:
      ds = task.get_dataset({"inputs": cfg.data.inputs_length,
                             "targets": cfg.data.targets_length},
                            split=rm.normalize_split, shuffle=False,
                            shard_info=shard, num_epochs=1)
    except (ValueError, KeyError) as e:
      raise ValueError(
          f"config.reward_model.normalize_split: cannot read split "
          f"{rm.normalize_split!r} of task {rm.normalize_on_task!r} ({e}).")
    # A reference completion is a trajectory's completion; its converter
    # lays it out like the pairs' completions for either architecture.
    ds = ds.map(lambda ex: {"prompt": ex["inputs"],
                            "completion": ex["targets"],
                            "reward": tf.constant(0.0, tf.float32)})
    kwargs = ({} if self.lm.is_encoder_decoder
              else {"eos_id": self.vocabulary.eos_id})
    converter = alignment_data.feature_converter_for(
        "trajectory", self.architecture, **kwargs)
    ds = converter(ds, {"prompt": cfg.data.inputs_length,
                        "completion": cfg.data.targets_length})
    if rm.normalize_num_examples:
      ds = ds.take(pipeline.local_batch_size(rm.normalize_num_examples))
    rows = list(ds.as_numpy_iterator())
    if not rows:
      raise ValueError(
          f"config.reward_model.normalize_on_task: split "
          f"{rm.normalize_split!r} of task {rm.normalize_on_task!r} gave no "
          "example to normalise the rewards with.")
    keys = [k for k in rows[0] if k != "reward"]
    self._reference = {k: np.stack([r[k] for r in rows]) for k in keys}
    return self._reference

  def reference_rewards(self, reward_params) -> np.ndarray:
    """[n] rewards of this process's reference completions."""
    features = self.reference_features()
    if not hasattr(self, "_reference_fn"):
      self._reference_fn = jax.jit(
          lambda p, b: heads.sequence_rewards(self.lm, p, b, "completion"))
    n = len(next(iter(features.values())))
    rewards = [evaluation.local_rows(self._reference_fn(reward_params, b))
               for b in evaluation.global_batches(
                   features, self.config.eval.batch_size, self.mesh,
                   self.rules)]
    return np.concatenate(rewards)[:n]

  def mean_reference_reward(self, reward_params) -> Tuple[float, int]:
    """(mean reward of the reference completions over all processes, their
    number)."""
    rewards = self.reference_rewards(reward_params).astype(np.float64)
    if not np.all(np.isfinite(rewards)):
      raise FloatingPointError(
          "reward normalisation: the reward model gives non-finite rewards "
          f"to {int(np.sum(~np.isfinite(rewards)))} reference completions.")
    total, count = float(rewards.sum()), float(rewards.size)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      sums = np.asarray(multihost_utils.process_allgather(
          np.array([total, count], np.float64))).reshape(-1, 2).sum(0)
      total, count = float(sums[0]), float(sums[1])
    return total / count, int(count)

  def normalize_reward_bias(self, state):
    """(state whose reward head's bias makes the reference completions score
    mean 0, {"reward_normalization/...": before/after means, shift, count}).

    Only the bias moves, so every reward moves by the same amount and reward
    differences (and pair accuracy) are unchanged.
    """
    rm = self.config.reward_model
    before, count = self.mean_reference_reward(state.params["reward"])
    if not hasattr(self, "_shift_bias_fn"):
      self._shift_bias_fn = jax.jit(
          lambda s, shift: s.replace(params=dict(
              s.params, reward=heads.shift_bias(s.params["reward"], shift))),
          in_shardings=(self.state_shardings, sharding.replicated(self.mesh)),
          out_shardings=self.state_shardings, donate_argnums=0)
    state = self._shift_bias_fn(state, np.float32(-before))
    after, _ = self.mean_reference_reward(state.params["reward"])
    metrics_lib.log(
        f"Reward normalisation: mean reward of {count} reference completions "
        f"({rm.normalize_on_task!r}, split {rm.normalize_split!r}) "
        f"{before:.6f} -> {after:.6f} (head bias shifted by {-before:.6f}).")
    return state, {"reward_normalization/mean_before": before,
                   "reward_normalization/mean_after": after,
                   "reward_normalization/bias_shift": -before,
                   "reward_normalization/num_examples": float(count)}

  def finish_training(self, state):
    """The final checkpoint holds the normalised head (the loop saves after
    this hook, atomically)."""
    if not self.config.reward_model.normalize_on_task:
      return state, {}
    return self.normalize_reward_bias(state)


class RankingRewardModelRecipe(RewardModelRecipe):
  """K-wise rankings (best first); K is `config.reward_model.num_completions`.
  The loss is `config.reward_model.ranking_loss`: Plackett-Luce, or
  Bradley-Terry on all C(K, 2) pairs of each ranking (InstructGPT)."""
  data_kind = "ranking"

  def make_feature_lengths(self):
    # seqio trims a ranking's first axis to the "completions" length, so it
    # must be at least K (the converter checks).
    return {"prompt": self.config.data.inputs_length,
            "completions": max(self.config.data.targets_length,
                               self.config.reward_model.num_completions)}

  def make_feature_converter(self):
    kwargs = ({} if self.lm.is_encoder_decoder
              else {"eos_id": self.vocabulary.eos_id})
    return alignment_data.feature_converter_for(
        "ranking", self.architecture,
        num_completions=self.config.reward_model.num_completions, **kwargs)

  def ranked_rewards(self, reward_params, batch):
    """[batch, K] rewards of each example's K completions (one pass over
    the batch's K * batch (prompt, completion) rows)."""
    b, k = batch["completions_mask"].shape
    flat = {key: jnp.repeat(batch[key], k, axis=0)
            for key in self.lm.prompt_keys if key in batch}
    for key in self.lm.completion_keys("completions"):
      flat[key] = batch[key].reshape((b * k,) + batch[key].shape[2:])
    rewards = heads.sequence_rewards(self.lm, reward_params, flat,
                                     "completions")
    return rewards.reshape(b, k)

  def ranking_loss(self, rewards, mask):
    if self.config.reward_model.ranking_loss == "all_pairs":
      return rm_losses.all_pairs_ranking_loss(rewards, mask)
    return rm_losses.plackett_luce_loss(rewards, mask)

  def loss(self, params, frozen, batch, rng):
    rewards = self.ranked_rewards(params["reward"], batch)
    return self.ranking_loss(rewards, batch["completions_mask"])

  def evaluate(self, state) -> Dict[str, float]:
    """The ranking loss, top-1 and pairwise accuracy on the eval split."""
    evaluated = self.eval_rewards(state, self.ranked_rewards)
    if evaluated is None:
      return {}
    rewards, features = evaluated
    _, m = self.ranking_loss(jnp.asarray(rewards),
                             jnp.asarray(features["completions_mask"]))
    return {f"eval/{name}": float(m[name])
            for name in ("loss", "top1_accuracy", "pairwise_accuracy")}

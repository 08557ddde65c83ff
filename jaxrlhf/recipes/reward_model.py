"""Reward modelling: Bradley-Terry on preference pairs (optional margin and
reward centring) and Plackett-Luce on K-wise rankings
(jaxrlhf.losses.reward_model).

The reward model is a copy of the policy backbone (`init.policy_checkpoint`)
with a scalar head read at the completion's EOS (jaxrlhf.models.heads).
"""

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.data import alignment_data
from jaxrlhf.data import pipeline
from jaxrlhf.eval import evaluation
from jaxrlhf.losses import reward_model as rm_losses
from jaxrlhf.models import heads
from jaxrlhf.models import scoring
from jaxrlhf.recipes import base


class RewardModelRecipe(base.Recipe):
  data_kind = "pairs"

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
    return rm_losses.bradley_terry_loss(chosen, rejected, margin=margin,
                                        centering_coef=cfg.centering_coef)

  def evaluate(self, state) -> Dict[str, float]:
    """Accuracy, loss and calibration on the eval split's pairs."""
    cfg = self.config
    if not hasattr(self, "_eval_pairs"):
      try:
        features, _ = pipeline.eval_examples(
            cfg.data.task, cfg.data.eval_split, self.feature_lengths,
            self.feature_converter, cfg.eval.num_examples)
      except (ValueError, KeyError, StopIteration):
        features = None
      self._eval_pairs = features
      self._pair_fn = jax.jit(self.pair_rewards)
    if self._eval_pairs is None:
      return {}
    n = len(self._eval_pairs["encoder_input_tokens"])
    chosen, rejected = [], []
    for batch in evaluation.global_batches(self._eval_pairs,
                                           cfg.eval.batch_size, self.mesh,
                                           self.rules):
      c, r = self._pair_fn(state.params["reward"], batch)
      chosen.append(evaluation.local_rows(c))
      rejected.append(evaluation.local_rows(r))
    chosen = np.concatenate(chosen)[:n]
    rejected = np.concatenate(rejected)[:n]
    _, m = rm_losses.bradley_terry_loss(jnp.asarray(chosen),
                                        jnp.asarray(rejected))
    table = rm_losses.calibration_table(jnp.asarray(chosen),
                                        jnp.asarray(rejected), num_bins=5)
    return {"eval/accuracy": float(m["accuracy"]),
            "eval/loss": float(m["bt_loss"]),
            "eval/margin": float(m["margin"]),
            "eval/expected_calibration_error":
                float(table["expected_calibration_error"])}


class RankingRewardModelRecipe(RewardModelRecipe):
  """K-wise rankings (best first) with the Plackett-Luce loss; K is
  `config.reward_model.num_completions`."""
  data_kind = "ranking"

  def make_feature_lengths(self):
    # seqio trims a ranking's first axis to the "completions" length, so it
    # must be at least K (the converter checks).
    return {"prompt": self.config.data.inputs_length,
            "completions": max(self.config.data.targets_length,
                               self.config.reward_model.num_completions)}

  def make_feature_converter(self):
    return alignment_data.feature_converter_for(
        "ranking", "encoder_decoder",
        num_completions=self.config.reward_model.num_completions)

  def ranked_rewards(self, reward_params, batch):
    """[batch, K] rewards of each example's K completions (one pass)."""
    b, k = batch["completions_mask"].shape
    flat = {"encoder_input_tokens": jnp.repeat(batch["encoder_input_tokens"],
                                               k, axis=0)}
    for suffix in ("decoder_target_tokens", "decoder_input_tokens",
                   "decoder_loss_weights"):
      x = batch[f"completions_{suffix}"]
      flat[f"completions_{suffix}"] = x.reshape((b * k,) + x.shape[2:])
    rewards = heads.sequence_rewards(self.lm, reward_params, flat, "completions")
    return rewards.reshape(b, k)

  def loss(self, params, frozen, batch, rng):
    rewards = self.ranked_rewards(params["reward"], batch)
    return rm_losses.plackett_luce_loss(rewards, batch["completions_mask"])

  def evaluate(self, state):
    return {}

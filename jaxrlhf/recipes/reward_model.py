"""Reward modelling on preference pairs (Bradley-Terry, optional margin and
reward centring); jaxrlhf.losses.reward_model.bradley_terry_loss.

The reward model is a copy of the policy backbone (`init.policy_checkpoint`)
with a scalar head read at the completion's EOS (jaxrlhf.models.heads).
"""

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.eval import evaluation
from jaxrlhf.data import pipeline
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

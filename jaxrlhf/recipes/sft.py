"""The SFT recipe: token cross-entropy on a seqio task, for T5.

A recipe owns what is specific to an algorithm: its networks and their
initialisation, the data it reads, its jitted train step and its evaluation.
The shared loop (`jaxrlhf.train.loop`) owns everything else.
"""

from typing import Dict

import jax
import jax.numpy as jnp
import seqio

from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks
from jaxrlhf.eval import evaluation
from jaxrlhf.losses import sft as sft_losses
from jaxrlhf.recipes import base
from jaxrlhf.train import optimizers
from jaxrlhf.train import steps


class SFTRecipe(base.Recipe):
  """Supervised fine-tuning of an encoder-decoder on a seqio task."""

  def __init__(self, config, mesh):
    super().__init__(config, mesh)
    if not self.lm.is_encoder_decoder:
      raise ValueError(
          f"config.model.arch: {config.model.arch!r}: SFT reads seqio's "
          "encoder-decoder features and supports T5 so far; decoder-only "
          "policies can be trained with the offline recipes (dpo, dro_v, "
          "reward_model) from a checkpoint (init.policy_checkpoint).")

  def make_feature_lengths(self):
    return {"inputs": self.config.data.inputs_length,
            "targets": self.config.data.targets_length}

  def make_feature_converter(self):
    return seqio.EncDecFeatureConverter(pack=False)

  def init_trainable(self, rng):
    return {"policy": self.init_lm(rng)}

  def pretrained_paths(self):
    return {"params/policy": self.config.init.policy_checkpoint}

  def _train_step(self, state, batch):
    # Token-level mean over the whole batch: each micro-batch's loss is
    # normalised by the whole batch's weight, so their sum is exact.
    rng, step_rng = jax.random.split(state.rng)
    denom = jnp.maximum(
        jnp.sum(batch["decoder_loss_weights"].astype(jnp.float32)), 1.0)

    def loss_fn(params, mb, mb_rng):
      logits = self.lm.completion_logits(params["policy"], mb, None,
                                         self._dropout_rng(mb_rng))
      mean_loss, m = sft_losses.cross_entropy_loss(
          logits, mb["decoder_target_tokens"], mb["decoder_loss_weights"],
          self.config.train.z_loss)
      return mean_loss * jnp.maximum(m["weight_sum"], 1.0) / denom, m

    loss, sums, grads = steps.accumulate_gradients(
        loss_fn, state.params, batch, step_rng,
        self.config.train.num_microbatches)
    weight = jnp.maximum(sums["weight_sum"], 1.0)
    params, opt_state, metrics = steps.guarded_update(
        state, grads, loss, self.tx, {
            "nll": sums["nll_sum"] / weight,
            "token_accuracy": sums["correct_sum"] / weight,
            "learning_rate": optimizers.learning_rate_schedule(
                self.config.optimizer, self.config.train.num_steps)(state.step),
        })
    new_state = state.replace(step=state.step + 1, params=params,
                              opt_state=opt_state, rng=rng)
    return new_state, metrics

  def _dropout_rng(self, rng):
    return rng if self.config.model.dropout_rate > 0 else None

  # --- evaluation ----------------------------------------------------------

  def evaluate(self, state) -> Dict[str, float]:
    """Held-out loss, token accuracy and (if the task has one) the gold reward
    of greedy decodes."""
    cfg = self.config
    if not hasattr(self, "_eval"):
      features, texts = pipeline.eval_examples(
          cfg.data.task, cfg.data.eval_split, self.feature_lengths,
          self.feature_converter, cfg.eval.num_examples)
      logits_fn = jax.jit(lambda p, b: self.lm.completion_logits(p, b))
      self._eval = (features, texts, logits_fn)
    features, texts, logits_fn = self._eval
    policy = state.params["policy"]
    nll = correct = weight = 0.0
    for batch in evaluation.global_batches(features, cfg.eval.batch_size,
                                           self.mesh, self.rules):
      _, m = sft_losses.cross_entropy_loss(
          logits_fn(policy, batch), batch["decoder_target_tokens"],
          batch["decoder_loss_weights"])
      nll += float(m["nll_sum"])
      correct += float(m["correct_sum"])
      weight += float(m["weight_sum"])
    metrics = {"eval/loss": nll / max(weight, 1.0),
               "eval/token_accuracy": correct / max(weight, 1.0)}
    gold = tasks.gold_reward_for(cfg.data.task)
    if gold is not None:
      prompts = [t["inputs"] for t in texts]
      metrics.update(evaluation.gold_reward_of_samples(
          self, policy, features["encoder_input_tokens"], prompts, gold,
          greedy=True))
    return metrics

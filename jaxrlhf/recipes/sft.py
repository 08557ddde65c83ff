"""The SFT recipe: token cross-entropy on a seqio `inputs`/`targets` task.

Encoder-decoder models (T5) read seqio's EncDecFeatureConverter features.
Decoder-only models (Llama, GPT-NeoX, t5x decoder-only) read the prompt and
target concatenated and right-padded, with loss weights on the target tokens
and their EOS only (`feature_converters.DecoderSFTFeatureConverter`; PPO-paper
details 3 and 5), so the loss is -mean log p(target tokens | prompt).

A recipe owns what is specific to an algorithm: its networks and their
initialisation, the data it reads, its jitted train step and its evaluation.
The shared loop (`jaxrlhf.train.loop`) owns everything else.
"""

from typing import Dict

import jax
import jax.numpy as jnp

from jaxrlhf.data import feature_converters
from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks
from jaxrlhf.eval import evaluation
from jaxrlhf.losses import sft as sft_losses
from jaxrlhf.recipes import base
from jaxrlhf.train import optimizers
from jaxrlhf.train import steps


def next_token_targets(lm, params, batch, rng=None):
  """Logits aligned with the tokens they predict, for either architecture.

  Encoder-decoder: decoder logits at t score `decoder_target_tokens` t.
  Decoder-only: the logits at t score token t+1 of `tokens`, so the last
  position is dropped from the logits and the first from the targets and
  their weights (the first token is never predicted; it is a prompt token,
  or BOS).

  Args:
    lm: a scoring adapter (`jaxrlhf.models.scoring`).
    params: the model's parameters.
    batch: SFT features of lm's architecture (unprefixed names).
    rng: dropout RNG, or None for a deterministic pass.
  Returns:
    (logits [batch, T, vocab], targets [batch, T], weights [batch, T]).
  """
  logits = lm.completion_logits(params, batch, None, rng)
  if lm.is_encoder_decoder:
    return (logits, batch["decoder_target_tokens"], target_weights(lm, batch))
  return logits[:, :-1], batch["tokens"][:, 1:], target_weights(lm, batch)


def target_weights(lm, batch):
  """[batch, T] loss weights of the tokens `next_token_targets` scores."""
  if lm.is_encoder_decoder:
    return batch["decoder_loss_weights"]
  return batch["loss_weights"][:, 1:]


class SFTRecipe(base.Recipe):
  """Supervised fine-tuning of an encoder-decoder or decoder-only model."""

  def make_feature_lengths(self):
    return {"inputs": self.config.data.inputs_length,
            "targets": self.config.data.targets_length}

  def make_feature_converter(self):
    kwargs = ({} if self.lm.is_encoder_decoder
              else {"eos_id": self.vocabulary.eos_id})
    return feature_converters.sft_feature_converter(self.architecture,
                                                    **kwargs)

  def init_trainable(self, rng):
    return {"policy": self.init_lm(rng)}

  def pretrained_paths(self):
    return {"params/policy": self.config.init.policy_checkpoint}

  def _train_step(self, state, batch):
    # Token-level mean over the whole batch: each micro-batch's loss is
    # normalised by the whole batch's weight, so their sum is exact.
    rng, step_rng = jax.random.split(state.rng)
    denom = jnp.maximum(
        jnp.sum(target_weights(self.lm, batch).astype(jnp.float32)), 1.0)

    def loss_fn(params, mb, mb_rng):
      logits, targets, weights = next_token_targets(
          self.lm, params["policy"], mb, self._dropout_rng(mb_rng))
      mean_loss, m = sft_losses.cross_entropy_loss(
          logits, targets, weights, self.config.train.z_loss)
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

  def evaluation_description(self) -> str:
    return (f"{self.config.eval.num_examples} held-out examples, gold reward "
            "of greedy decodes")

  def evaluate(self, state) -> Dict[str, float]:
    """Held-out loss, token accuracy and (if the task has one) the gold reward
    of greedy decodes."""
    cfg = self.config
    if not hasattr(self, "_eval"):
      features, texts = pipeline.eval_examples(
          cfg.data.task, cfg.data.eval_split, self.feature_lengths,
          self.feature_converter, cfg.eval.num_examples)
      loss_fn = jax.jit(lambda p, b: sft_losses.cross_entropy_loss(
          *next_token_targets(self.lm, p, b))[1])
      self._eval = (features, texts, loss_fn)
    features, texts, loss_fn = self._eval
    policy = state.params["policy"]
    nll = correct = weight = 0.0
    for batch in evaluation.global_batches(features, cfg.eval.batch_size,
                                           self.mesh, self.rules):
      m = loss_fn(policy, batch)
      nll += float(m["nll_sum"])
      correct += float(m["correct_sum"])
      weight += float(m["weight_sum"])
    metrics = {"eval/loss": nll / max(weight, 1.0),
               "eval/token_accuracy": correct / max(weight, 1.0)}
    gold = tasks.gold_reward_for(cfg.data.task)
    if gold is not None:
      prompts = [t["inputs"] for t in texts]
      # Decoder-only prompts are already left-padded without their EOS;
      # evaluation.left_pad_prompts leaves such rows unchanged.
      prompt_tokens = features["encoder_input_tokens"
                               if self.lm.is_encoder_decoder
                               else "prompt_tokens"]
      metrics.update(evaluation.gold_reward_of_samples(
          self, policy, prompt_tokens, prompts, gold, greedy=True))
    return metrics

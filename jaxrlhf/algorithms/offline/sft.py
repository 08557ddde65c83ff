"""Supervised fine-tuning: token cross-entropy on a seqio `inputs`/`targets`
task.

Encoder-decoder models (T5) read seqio's EncDecFeatureConverter features.
Decoder-only models (Llama, GPT-NeoX, t5x decoder-only) read the prompt and
target concatenated and right-padded, with loss weights on the target tokens
and their EOS only (`feature_converters.DecoderSFTFeatureConverter`; PPO-paper
details 3 and 5), so the loss is -mean log p(target tokens | prompt), a mean
over the target tokens of the whole batch. Packed rows
(`config.data.pack`) give the same mean over the same tokens.
"""

from typing import Dict

import jax
import jax.numpy as jnp

from jaxrlhf import run_cache
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.offline import training
from jaxrlhf.eval import evaluation
from jaxrlhf.losses import sft_losses


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
  """[batch, T] loss weights of the tokens `next_token_targets` scores.

  In a packed decoder-only row the first token of an example is scored by
  the logits of the example before it: its weight is 0 (unpacked, the first
  token of a row is never scored)."""
  if lm.is_encoder_decoder:
    return batch["decoder_loss_weights"]
  weights = batch["loss_weights"][:, 1:]
  if "segment_ids" in batch:
    ids = batch["segment_ids"]
    weights = weights * (ids[:, 1:] == ids[:, :-1]).astype(weights.dtype)
  return weights


def target_segment_ids(lm, batch):
  """[batch, T] packed segment ids of the tokens `next_token_targets`
  scores."""
  return lm.completion_segment_ids(batch)[:, 0 if lm.is_encoder_decoder
                                          else 1:]


def token_cross_entropy(lm, params, batch, rng=None, z_loss=0.0):
  """(mean token cross-entropy, its token sums) of the targets
  `next_token_targets` scores, from the adapter's per-token statistics
  (`next_token_stats`): a decoder-only model's logits are formed a chunk
  of positions at a time and never held whole."""
  stats = lm.next_token_stats(params, batch, None, rng=rng, with_top1=True)
  return sft_losses.cross_entropy_from_stats(
      stats.log_z, stats.target_logits, stats.top1, target_weights(lm, batch),
      z_loss)


def loss(trainer, params, state, batch, rng):
  """Mean token cross-entropy of one (micro-)batch, and its token sums."""
  del state
  dropout_rng = rng if trainer.config.model.dropout_rate > 0 else None
  return token_cross_entropy(trainer.lm, params["policy"], batch, dropout_rng,
                             trainer.config.train.z_loss)


def token_mean_share(trainer, loss_fn, batch):
  """Micro-batch shares of a mean over the whole batch's target tokens:
  each micro-batch's token mean times its tokens / the batch's tokens, so
  micro-batches of different token counts add up exactly."""
  denom = jnp.maximum(
      jnp.sum(target_weights(trainer.lm, batch).astype(jnp.float32)), 1.0)

  def share(params, microbatch, rng):
    mean_loss, m = loss_fn(params, microbatch, rng)
    return (mean_loss * jnp.maximum(m["weight_sum"], 1.0) / denom,
            {"nll": m["nll_sum"] / denom,
             "token_accuracy": m["correct_sum"] / denom})
  return share


def policy(trainer, rng):
  return {"policy": trainer.init_lm(rng)}


def checkpoints(trainer):
  return {"params/policy": trainer.config.init.policy_checkpoint}


# --- evaluation ----------------------------------------------------------------


@run_cache.per_run
def _eval_examples(trainer):
  """(features, texts, compiled per-token loss) of the eval split's first
  eval.num_examples examples, read once; None without such a split."""
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  splits = getattr(pipeline.get_task(cfg.data.task), "splits", None)
  if splits is not None and cfg.data.eval_split not in splits:
    return None
  features, texts = pipeline.eval_examples(
      cfg.data.task, cfg.data.eval_split, trainer.feature_lengths,
      trainer.feature_converter, cfg.eval.num_examples)
  loss_fn = jax.jit(lambda p, b: token_cross_entropy(trainer.lm, p, b)[1])
  return features, texts, loss_fn


def evaluate(trainer, state) -> Dict[str, float]:
  """Held-out loss, token accuracy and (if the task has one) the gold reward
  of greedy decodes; {} when the task has no data.eval_split (files without
  data.files.validation)."""
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  prepared = _eval_examples(trainer)
  if prepared is None:
    return {}
  features, texts, loss_fn = prepared
  policy_params = state.params["policy"]
  nll = correct = weight = 0.0
  for batch in evaluation.global_batches(features, cfg.eval.batch_size,
                                         trainer.mesh, trainer.rules):
    m = loss_fn(policy_params, batch)
    nll += float(m["nll_sum"])
    correct += float(m["correct_sum"])
    weight += float(m["weight_sum"])
  metrics = {"eval/loss": nll / max(weight, 1.0),
             "eval/token_accuracy": correct / max(weight, 1.0)}
  gold = tasks.gold_reward_for(cfg.data.task)
  if gold is not None:
    prompts = [t["inputs"] for t in texts]
    # Decoder-only prompts are already left-padded without their EOS;
    # re-padding them leaves such rows unchanged.
    prompt_tokens = features["encoder_input_tokens"
                             if trainer.lm.is_encoder_decoder
                             else "prompt_tokens"]
    metrics.update(evaluation.gold_reward_of_samples(
        trainer, policy_params, prompt_tokens, prompts, gold, greedy=True))
  return metrics


def describe(config) -> str:
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  examples = f"{config.eval.num_examples} held-out examples"
  if tasks.gold_reward_for(config.data.task) is None:
    return examples
  return examples + ", gold reward of greedy decodes"


ALGORITHM = base.Algorithm(
    name="sft",
    summary="Supervised fine-tuning: token cross-entropy on the targets of a "
    "seqio task's (inputs, targets).",
    data=base.SFT_DATA,
    networks=base.Networks(trainable=policy, checkpoints=checkpoints),
    training=training.Offline(loss=loss, share=token_mean_share,
                             packs=True),
    evaluation=base.Evaluation(evaluate=evaluate, describe=describe),
)

"""The SFT recipe: token cross-entropy on a seqio task, for T5.

A recipe owns what is specific to an algorithm: its networks and their
initialisation, the data it reads, its jitted train step and its evaluation.
The shared loop (`jaxrlhf.train.loop`) owns everything else.
"""

import logging
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
import seqio

from jaxrlhf import sharding
from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks
from jaxrlhf.losses import sft as sft_losses
from jaxrlhf.models import build_model
from jaxrlhf.models import sampling
from jaxrlhf.train import optimizers
from jaxrlhf.train import state as state_lib
from jaxrlhf.train import steps


class SFTRecipe:
  """Supervised fine-tuning of an encoder-decoder on a seqio task."""

  def __init__(self, config, mesh):
    self.config = config
    self.mesh = mesh
    self.rules = sharding.as_rules(config.sharding.logical_axis_rules)
    pipeline.import_task_modules(config.data.task_modules)
    task = pipeline.get_task(config.data.task)
    self.vocabulary = task.output_features["targets"].vocabulary
    self.model, self.model_config = build_model(config.model,
                                                self.vocabulary.vocab_size)
    self.feature_lengths = {"inputs": config.data.inputs_length,
                            "targets": config.data.targets_length}
    self.feature_converter = seqio.EncDecFeatureConverter(pack=False)
    self.schedule = optimizers.learning_rate_schedule(config.optimizer,
                                                      config.train.num_steps)
    self.tx = optimizers.make_optimizer(config.optimizer, config.train.num_steps)
    dp = sharding.data_parallel_size(mesh, self.rules)
    per_shard = config.train.batch_size // config.train.num_microbatches
    if per_shard % dp:
      raise ValueError(
          f"config.train.batch_size: {config.train.batch_size} / "
          f"{config.train.num_microbatches} micro-batches = {per_shard} rows "
          f"cannot be split over {dp} data-parallel shards.")
    self._init, self.state_shardings, self.abstract_state = (
        state_lib.make_sharded_init(self._init_params, self.tx, mesh,
                                    self.rules))
    batch_shardings = {
        k: sharding.batch_sharding(mesh, self.rules, 2)
        for k in ("encoder_input_tokens", "decoder_input_tokens",
                  "decoder_target_tokens", "decoder_loss_weights")}
    self.train_step = jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, batch_shardings),
        out_shardings=(self.state_shardings, sharding.replicated(mesh)),
        donate_argnums=0)
    self._eval_logits = jax.jit(self._logits)
    self._decode = jax.jit(
        lambda params, tokens: sampling.sample_encoder_decoder(
            self.model, params, tokens, jax.random.PRNGKey(0),
            config.data.targets_length, greedy=True,
            eos_id=self.vocabulary.eos_id))
    self._eval_features = None

  # --- state ---------------------------------------------------------------

  def _init_params(self, rng):
    enc = jnp.ones((1, self.config.data.inputs_length), jnp.int32)
    dec = jnp.ones((1, self.config.data.targets_length), jnp.int32)
    return self.model.init(rng, enc, dec, dec)["params"]

  def init_state(self):
    return self._init(jax.random.PRNGKey(self.config.seed))

  # --- training ------------------------------------------------------------

  def train_batches(self, position: int):
    return pipeline.BatchIterator(
        self.config.data.task, self.config.data.train_split,
        self.feature_lengths, self.feature_converter,
        self.config.train.batch_size, seed=self.config.seed, shuffle=True,
        position=position)

  def tokens_in(self, local_batch) -> int:
    """Target tokens in a global batch (for tokens/s)."""
    return int(np.sum(local_batch["decoder_loss_weights"])) * jax.process_count()

  def _logits(self, params, batch, rng=None):
    deterministic = rng is None or self.config.model.dropout_rate == 0.0
    return self.model.apply(
        {"params": params}, batch["encoder_input_tokens"],
        batch["decoder_input_tokens"], batch["decoder_target_tokens"],
        deterministic=deterministic,
        rngs=None if deterministic else {"dropout": rng})

  def _train_step(self, state, batch):
    rng, step_rng = jax.random.split(state.rng)
    # Normalising by the whole batch's weight makes micro-batch sums exact.
    denom = jnp.maximum(
        jnp.sum(batch["decoder_loss_weights"].astype(jnp.float32)), 1.0)

    def loss_fn(params, mb, mb_rng):
      logits = self._logits(params, mb, mb_rng)
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
            "learning_rate": self.schedule(state.step),
        })
    new_state = state.replace(step=state.step + 1, params=params,
                              opt_state=opt_state, rng=rng)
    return new_state, metrics

  # --- evaluation ----------------------------------------------------------

  def _load_eval(self):
    if self._eval_features is None:
      cfg = self.config
      features, texts = pipeline.eval_examples(
          cfg.data.task, cfg.data.eval_split, self.feature_lengths,
          self.feature_converter, cfg.eval.num_examples)
      self._eval_features, self._eval_texts = features, texts
    return self._eval_features, self._eval_texts

  def evaluate(self, state) -> Dict[str, float]:
    """Held-out loss, token accuracy and (if the task has one) the gold reward
    of greedy decodes."""
    features, texts = self._load_eval()
    cfg = self.config
    n = len(texts)
    bs = cfg.eval.batch_size
    nll = correct = weight = 0.0
    reward_sum, finished_sum = 0.0, 0.0
    gold = tasks.gold_reward_for(cfg.data.task)
    for start in range(0, n, bs):
      rows = slice(start, min(start + bs, n))
      local = {k: _pad_rows(v[rows], bs) for k, v in features.items()}
      batch = sharding.global_batch(local, self.mesh, self.rules)
      logits = self._eval_logits(state.params, batch)
      _, m = sft_losses.cross_entropy_loss(
          logits, batch["decoder_target_tokens"], batch["decoder_loss_weights"])
      nll += float(m["nll_sum"])
      correct += float(m["correct_sum"])
      weight += float(m["weight_sum"])
      if gold is not None:
        samples = self._decode(state.params, batch["encoder_input_tokens"])
        tokens = _local_rows(samples.tokens)
        finished = _local_rows(samples.has_eos)
        for i, text in enumerate(texts[rows]):
          completion = self.vocabulary.decode(_until_eos(tokens[i]))
          reward_sum += gold(text["inputs"], completion, bool(finished[i]))
          finished_sum += float(finished[i])
    metrics = {"eval/loss": nll / max(weight, 1.0),
               "eval/token_accuracy": correct / max(weight, 1.0)}
    if gold is not None:
      metrics["eval/gold_reward"] = _global_mean(reward_sum, n)
      metrics["eval/eos_rate"] = _global_mean(finished_sum, n)
    return metrics


def _pad_rows(x, rows):
  """Pads a [n, ...] array with zero rows to [rows, ...]."""
  if x.shape[0] == rows:
    return x
  pad = np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
  return np.concatenate([x, pad])


def _local_rows(array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in order."""
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
  seen, rows = set(), []
  for s in shards:
    start = s.index[0].start or 0
    if start not in seen:
      seen.add(start)
      rows.append(np.asarray(s.data))
  return np.concatenate(rows)


def _until_eos(tokens, eos_id=1):
  tokens = list(int(t) for t in tokens)
  return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


def _global_mean(local_sum: float, local_count: int) -> float:
  if jax.process_count() == 1:
    return local_sum / max(local_count, 1)
  from jax.experimental import multihost_utils
  totals = multihost_utils.process_allgather(
      np.array([local_sum, local_count], np.float64))
  totals = np.asarray(totals).reshape(-1, 2).sum(0)
  return float(totals[0] / max(totals[1], 1))

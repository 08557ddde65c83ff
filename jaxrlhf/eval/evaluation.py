"""Evaluating policies by side-by-side comparison of their outputs.

A policy is compared with its reference (the SFT policy) on held-out
prompts, as the DRO paper does: a judge (`jaxrlhf.eval.judges`: the task's
gold reward, which here is exact, a reward model, or your own pairwise
function such as an LLM judge) decides each comparison; reported are the
win rate (ties count half) with its standard error (and, over folds of
prompts, the spread of the fold win rates), the KL from the reference
estimated on the policy's own samples, mean length and EOS rate, and what
the judge measures (e.g. mean gold rewards).
"""

import functools
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import sharding
from jaxrlhf.models import sampling
from jaxrlhf.rl import rollout


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  """Pads a [n, ...] array with zero rows to [rows, ...]."""
  if x.shape[0] == rows:
    return x
  pad = np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)
  return np.concatenate([x, pad])


def local_rows(array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in order."""
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
  seen, rows = set(), []
  for s in shards:
    start = s.index[0].start or 0
    if start not in seen:
      seen.add(start)
      rows.append(np.asarray(s.data))
  return np.concatenate(rows)


def until_eos(tokens, eos_id: int = 1) -> List[int]:
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(eos_id)] if eos_id in tokens else tokens


def global_mean(local_sum: float, local_count: float) -> float:
  """Mean over all processes of per-process sums and counts."""
  if jax.process_count() == 1:
    return local_sum / max(local_count, 1)
  from jax.experimental import multihost_utils
  totals = multihost_utils.process_allgather(
      np.array([local_sum, local_count], np.float64))
  totals = np.asarray(totals).reshape(-1, 2).sum(0)
  return float(totals[0] / max(totals[1], 1))


def global_batches(features: Dict[str, np.ndarray], batch_size: int, mesh,
                   rules) -> Iterator[Dict[str, jax.Array]]:
  """Global batches of this process's feature rows, zero-padded at the end
  (padded rows have zero loss weights and are dropped by callers)."""
  n = len(next(iter(features.values())))
  for start in range(0, n, batch_size):
    local = {k: pad_rows(v[start:start + batch_size], batch_size)
             for k, v in features.items()}
    yield sharding.global_batch(local, mesh, rules)


@functools.lru_cache(maxsize=None)
def _sampler(lm, max_new_tokens, greedy, temperature, eos_id):
  if lm.is_encoder_decoder:
    return jax.jit(lambda params, b, rng: sampling.sample_encoder_decoder(
        lm.module, params, b["tokens"], rng, max_new_tokens,
        temperature=temperature, greedy=greedy, eos_id=eos_id))
  return jax.jit(lambda params, b, rng: sampling.sample_decoder_only(
      lm.module, params, b["tokens"], b["mask"], rng, max_new_tokens,
      temperature=temperature, greedy=greedy, eos_id=eos_id))


def _prompt_features(lm, eos_id: int, prompt_tokens):
  if lm.is_encoder_decoder:
    return {"tokens": prompt_tokens}
  tokens, mask = jax.tree.map(np.asarray, rollout.left_pad_prompts(
      prompt_tokens, eos_id))
  return {"tokens": tokens, "mask": mask}


def sample(trainer, params, prompt_tokens: np.ndarray, *, greedy: bool,
           temperature: float = 1.0, seed: int = 0,
           max_new_tokens: Optional[int] = None) -> sampling.Samples:
  """Completions for this process's prompts [n, Lp] (encoder-style: right-
  padded, ending in EOS; re-padded for decoder-only models), as numpy, of
  at most `max_new_tokens` tokens (default config.data.targets_length).

  `trainer` is any object with the run's `config`, `lm`, `vocabulary`,
  `mesh` and `rules` (a `jaxrlhf.algorithms.trainer.Trainer`)."""
  cfg = trainer.config
  fn = _sampler(trainer.lm, max_new_tokens or cfg.data.targets_length,
                greedy, temperature, trainer.vocabulary.eos_id)
  n = len(prompt_tokens)
  parts = []
  for i, batch in enumerate(global_batches(
      _prompt_features(trainer.lm, trainer.vocabulary.eos_id, prompt_tokens),
      cfg.eval.batch_size,
      trainer.mesh, trainer.rules)):
    out = fn(params, batch, jax.random.PRNGKey(seed * 100003 + i))
    # The per-row arrays; the decode steps a batch ran are its own.
    parts.append(jax.tree.map(local_rows, out.replace(num_steps=None)))
  merged = jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *parts)
  return merged


def completion_texts(vocabulary, samples: sampling.Samples) -> List[str]:
  return [vocabulary.decode(until_eos(row, vocabulary.eos_id))
          for row in samples.tokens]


def gold_rewards(gold: Callable, prompts: Sequence[str],
                 completions: Sequence[str], finished) -> np.ndarray:
  return np.array([gold(p, c, bool(f))
                   for p, c, f in zip(prompts, completions, finished)])


def gold_reward_of_samples(trainer, params, prompt_tokens, prompts, gold, *,
                           greedy: bool, temperature: float = 1.0,
                           seed: int = 0) -> Dict[str, float]:
  """Mean gold reward, EOS rate and length of the policy's completions."""
  s = sample(trainer, params, prompt_tokens, greedy=greedy,
             temperature=temperature, seed=seed)
  rewards = gold_rewards(gold, prompts,
                         completion_texts(trainer.vocabulary, s), s.has_eos)
  n = len(rewards)
  return {"eval/gold_reward": global_mean(rewards.sum(), n),
          "eval/eos_rate": global_mean(float(np.sum(s.has_eos)), n),
          "eval/length": global_mean(float(np.sum(s.mask)), n)}


@functools.lru_cache(maxsize=None)
def _scorer(lm, temperature: float):
  return jax.jit(lambda p, b: jnp.sum(
      lm.completion_logprobs(p, b, None, temperature)[0], axis=-1))


def sequence_logprobs(trainer, params, prompt_tokens, samples,
                      temperature: float = 1.0) -> np.ndarray:
  """log p(completion | prompt) under `params` at `temperature` for sampled
  completions (teacher forcing), as numpy [n]."""
  features = jax.tree.map(np.asarray, rollout.response_features(
      trainer.lm, jnp.asarray(prompt_tokens), jnp.asarray(samples.tokens),
      jnp.asarray(samples.mask), trainer.vocabulary.eos_id))
  n = len(prompt_tokens)
  score = _scorer(trainer.lm, temperature)
  out = [local_rows(score(params, b)) for b in global_batches(
      features, trainer.config.eval.batch_size, trainer.mesh, trainer.rules)]
  return np.concatenate(out)[:n]


def compare_with_reference(trainer, policy, reference, prompt_tokens,
                           prompts: Sequence[str], judge, *,
                           num_samples: int = 1, temperature: float = 1.0,
                           seed: int = 0, num_folds: int = 1
                           ) -> Dict[str, float]:
  """Win rate against the reference and the other headline numbers.

  For each prompt and each of `num_samples` draws, the policy's completion
  is compared with an independent reference completion by `judge`
  (`jaxrlhf.eval.judges`: the gold reward, a reward model or your pairwise
  function; ties count 1/2). `eval/win_rate_stderr` is the standard error
  of the mean over all comparisons. With `num_folds` F > 1 the prompts are
  also split into F folds (consecutive blocks of each process's prompts),
  and `eval/win_rate_fold_std` / `eval/win_rate_fold_stderr` are the
  standard deviation of the F fold win rates and its standard error
  (std / sqrt(F)): the DRO paper's "5 evaluation folds of 1,000 test
  prompts". KL(policy || reference) is estimated per sequence as
  log pi(y) - log pi_ref(y) on policy samples y, both at the sampling
  temperature (the distributions the samples come from, as in the online
  trainers' KL penalty): unbiased, and exactly 0 when the policy is the
  reference.
  """
  outcomes, judged, kls, lengths, ends = [], {}, [], [], []
  for k in range(num_samples):
    mine = sample(trainer, policy, prompt_tokens, greedy=False,
                  temperature=temperature, seed=seed + 2 * k)
    theirs = sample(trainer, reference, prompt_tokens, greedy=False,
                    temperature=temperature, seed=seed + 2 * k + 1)
    outcome, values = judge(trainer, prompt_tokens, prompts, mine, theirs)
    outcomes.append(outcome)
    for name, value in values.items():
      judged.setdefault(name, []).append(value)
    # Both sides scored by the same teacher-forced pass at the sampling
    # temperature (the distributions the samples come from): a policy that
    # is its reference then gets a KL of exactly 0, not the rounding
    # difference between the sampler's incremental and a full forward pass.
    kls.append(sequence_logprobs(trainer, policy, prompt_tokens, mine,
                                 temperature)
               - sequence_logprobs(trainer, reference, prompt_tokens, mine,
                                   temperature))
    lengths.append(np.sum(mine.mask, -1))
    ends.append(mine.has_eos)
  metrics = judged_metrics(outcomes, judged)
  n = sum(len(o) for o in outcomes)
  cat = lambda xs: np.concatenate(xs).astype(np.float64)
  metrics.update({
      "eval/kl": global_mean(cat(kls).sum(), n),
      "eval/length": global_mean(cat(lengths).sum(), n),
      "eval/eos_rate": global_mean(cat(ends).sum(), n),
  })
  if num_folds > 1:
    metrics.update(fold_statistics(
        np.stack(outcomes).astype(np.float64), num_folds))
  return metrics


def judged_metrics(outcomes: List[np.ndarray],
                   judged: Dict[str, list]) -> Dict[str, float]:
  """eval/win_rate and its standard error over all comparisons, and the
  mean of each value a judge reported.

  Args:
    outcomes: per draw, this process's [n] outcomes (1 win, 1/2 tie, 0).
    judged: {metric: per draw, [n] values, or (sums, counts) [n] for a mean
      over a subset (e.g. the samples that end)}.
  """
  cat = lambda xs: np.concatenate(xs).astype(np.float64)
  flat = cat(outcomes)
  n = len(flat)
  win = global_mean(flat.sum(), n)
  second = global_mean(np.square(flat).sum(), n)
  count = global_mean(float(n), 1) * jax.process_count()
  metrics = {
      "eval/win_rate": win,
      "eval/win_rate_stderr": float(np.sqrt(max(second - win ** 2, 0.0)
                                            / max(count - 1, 1))),
  }
  for name, values in judged.items():
    if isinstance(values[0], tuple):
      metrics[name] = global_mean(cat([v for v, _ in values]).sum(),
                                  cat([c for _, c in values]).sum())
    else:
      metrics[name] = global_mean(cat(values).sum(), n)
  return metrics


def fold_statistics(outcomes: np.ndarray, num_folds: int) -> Dict[str, float]:
  """Spread of the win rate over folds of prompts.

  Args:
    outcomes: [num_samples, n] this process's outcomes, prompts in order.
    num_folds: F; fold f holds prompts [f * n / F, (f + 1) * n / F) of
      every process.
  Returns:
    {"eval/win_rate_fold_std": sample standard deviation (ddof 1) of the F
    fold win rates, "eval/win_rate_fold_stderr": that over sqrt(F)}.
  """
  n = outcomes.shape[1]
  fold = np.arange(n) * num_folds // max(n, 1)
  rates = np.array([
      global_mean(float(outcomes[:, fold == f].sum()),
                  float(outcomes[:, fold == f].size))
      for f in range(num_folds)])
  std = float(np.std(rates, ddof=1))
  return {"eval/win_rate_fold_std": std,
          "eval/win_rate_fold_stderr": std / np.sqrt(num_folds)}

"""Held-out accuracy as the reasoning papers report it: pass@1, mean@n and
pass@k of a policy's completions, scored by the run's own rewards.

A completion *passes* when its score (the weighted sum of the rewards that
judge it, a reward that does not apply to its row counting 0, as in
training) is at least a threshold: for a 0/1 reward such as the math
verifier's, with weight 1 and threshold 1, when it is right.

  pass@1   the share of prompts whose greedy completion passes.
  mean@n   the mean score of n completions per prompt sampled at a
           temperature.
  pass@k   the chance that at least one of k completions passes, estimated
           from n >= k samples per prompt with c passing by the unbiased
           estimator of Chen et al. 2021 (HumanEval), 1 - C(n-c, k) / C(n, k),
           averaged over prompts; with n == k it is "any of the k passes".
"""

from typing import Dict, Sequence

import numpy as np

from jaxrlhf.eval import evaluation


def pass_at_k(n: int, c, k: int) -> np.ndarray:
  """The unbiased pass@k estimate 1 - C(n-c, k) / C(n, k) per prompt.

  Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) (Chen et al. 2021's
  numerically stable form; no large binomials).

  Args:
    n: samples drawn per prompt.
    c: [prompts] (or a scalar) how many of them passed, 0 <= c <= n.
    k: 1 <= k <= n.
  Returns:
    [prompts] float64 in [0, 1] (a scalar's shape for a scalar c).
  """
  if not 1 <= k <= n:
    raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per prompt.")
  c = np.asarray(c)
  if np.any((c < 0) | (c > n)):
    raise ValueError(f"passing counts must lie in [0, {n}], got {c}.")
  out = np.ones(c.shape, np.float64)
  for index in np.ndindex(c.shape):
    failed = n - int(c[index])
    if failed >= k:  # else every choice of k holds a passing sample
      out[index] = 1.0 - np.prod(1.0 - k / np.arange(failed + 1, n + 1))
  return out


def parse_ks(text: str, n: int, field: str = "config.eval.pass_k"):
  """"2,8" -> (2, 8): the k values of pass@k, each in [2, n]; '' = (n,)
  (none when n is 0: nothing is sampled)."""
  if not text.strip():
    return (n,) if n > 1 else ()
  try:
    ks = tuple(sorted({int(part) for part in text.split(",")
                       if part.strip()}))
  except ValueError:
    raise ValueError(f"{field}: {text!r} is not a comma-separated list of "
                     "whole numbers such as '2,8'.") from None
  for k in ks:
    if not 2 <= k <= n:
      raise ValueError(
          f"{field}: pass@{k} needs 2 <= k <= config.eval.samples_per_prompt "
          f"({n}): pass@1 is the greedy completion's (eval/pass@1); raise "
          "samples_per_prompt or drop that k.")
  return ks


def combined(components: np.ndarray, weights: Sequence[float]) -> np.ndarray:
  """[...] the weighted sum of rewards [..., num rewards], NaN (the reward
  does not apply) counting 0."""
  w = np.asarray(weights, np.float64)
  return np.sum(np.where(np.isnan(components), 0.0, components) * w, axis=-1)


def _source_means(prefix: str, suffix: str, components: np.ndarray,
                  names: Sequence[str]) -> Dict[str, float]:
  """{prefix<name>suffix: the mean of each reward over the rows it applies
  to} (over all processes; a reward that applies to none is left out)."""
  flat = components.reshape(-1, len(names)).astype(np.float64)
  out = {}
  for i, name in enumerate(names):
    applies = ~np.isnan(flat[:, i])
    count = float(np.sum(applies))
    total = float(np.sum(flat[applies, i]))
    if evaluation.global_mean(count, 1.0) > 0:  # it applies somewhere
      out[f"{prefix}{name}{suffix}"] = evaluation.global_mean(total, count)
  return out


def reward_metrics(greedy: np.ndarray, sampled: np.ndarray,
                   names: Sequence[str], weights: Sequence[float],
                   threshold: float, ks: Sequence[int]) -> Dict[str, float]:
  """The held-out metrics (module docstring) over all processes.

  Args:
    greedy: [prompts, num rewards] this process's greedy completions'
      rewards (NaN: the reward does not apply to the row).
    sampled: [prompts, n, num rewards] its sampled completions' rewards
      (n may be 0: no mean@n, no pass@k).
    names, weights: each reward's name and weight.
    threshold: the score a completion needs to pass.
    ks: the k values of pass@k, each <= n.
  Returns:
    {"eval/pass@1", "eval/reward" (the greedy completions' mean score),
    "eval/reward/<name>" (each reward's mean on them), and with n > 0
    "eval/mean@<n>", "eval/reward/<name>_mean@<n>", "eval/pass@<k>"}.
  """
  num_prompts = len(greedy)
  score = combined(greedy, weights)
  metrics = {
      "eval/pass@1": evaluation.global_mean(
          float(np.sum(score >= threshold)), num_prompts),
      "eval/reward": evaluation.global_mean(float(np.sum(score)),
                                            num_prompts),
  }
  metrics.update(_source_means("eval/reward/", "", greedy, names))
  n = sampled.shape[1]
  if n:
    scores = combined(sampled, weights)  # [prompts, n]
    metrics[f"eval/mean@{n}"] = evaluation.global_mean(
        float(np.sum(scores)), scores.size)
    metrics.update(_source_means("eval/reward/", f"_mean@{n}", sampled,
                                 names))
    passed = np.sum(scores >= threshold, axis=1)
    for k in ks:
      metrics[f"eval/pass@{k}"] = evaluation.global_mean(
          float(np.sum(pass_at_k(n, passed, k))), num_prompts)
  return metrics

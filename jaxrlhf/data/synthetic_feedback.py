"""Synthetic feedback: label sampled completions with a gold reward.

Given prompts, completions sampled for each prompt (by any policy; sampling
needs a trained model and lives elsewhere) and a gold reward r*(prompt,
completion), these builders make the data kinds a real annotator would give,
and write them as JSON lines in the "columns" layout that
`alignment_data.register_file_task` reads. Synthetic experiments then run on
the same path as real data.

Annotator noise follows Bradley-Terry: completion a is preferred to b with
probability sigmoid(beta * (r*(a) - r*(b))). `beta` is the annotator's
inverse temperature: beta=inf is a noiseless annotator (ties broken by a
fair coin), beta=0 a random one. Rankings follow Plackett-Luce with weights
exp(beta * r*), which is Bradley-Terry for K=2; they are sampled by sorting
beta * r* + Gumbel noise.

Rows also carry the gold rewards (`chosen_gold_reward`, ...) for analysis;
the file sources ignore columns a kind does not map.
"""

import itertools
import json
import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

GoldReward = Callable[[str, str], float]


def preference_probability(reward_a: float, reward_b: float,
                           beta: float) -> float:
  """P(a preferred to b) = sigmoid(beta * (reward_a - reward_b))."""
  delta = reward_a - reward_b
  if math.isinf(beta):
    return 1.0 if delta > 0 else 0.0 if delta < 0 else 0.5
  z = beta * delta
  # Two branches keep exp() from overflowing for large |z|.
  if z >= 0:
    return 1.0 / (1.0 + math.exp(-z))
  e = math.exp(z)
  return e / (1.0 + e)


def _check_inputs(prompts: Sequence[str],
                  completions: Sequence[Sequence[str]], beta: float):
  if len(prompts) != len(completions):
    raise ValueError(f"{len(prompts)} prompts but {len(completions)} lists of "
                     "completions; give one list per prompt.")
  if not beta >= 0:
    raise ValueError(f"beta must be >= 0 (inf: noiseless), got {beta}.")


def label_pairs(prompts: Sequence[str], completions: Sequence[Sequence[str]],
                gold_reward: GoldReward, *, beta: float, seed: int,
                max_pairs_per_prompt: Optional[int] = None
                ) -> List[Dict[str, object]]:
  """Preference pairs labelled by a Bradley-Terry annotator on the gold reward.

  Every unordered pair of a prompt's completions (or `max_pairs_per_prompt`
  of them, drawn without replacement) is shown to the annotator once, in
  prompt order then pair order.

  Args:
    prompts: [num_prompts] prompt texts.
    completions: per prompt, the sampled completion texts.
    gold_reward: r*(prompt, completion) -> float.
    beta: annotator inverse temperature (inf: noiseless).
    seed: the labels are a deterministic function of the inputs and seed.
    max_pairs_per_prompt: None uses all pairs.

  Returns:
    Rows {"prompt", "chosen", "rejected", "chosen_gold_reward",
    "rejected_gold_reward"}.
  """
  _check_inputs(prompts, completions, beta)
  rng = np.random.default_rng(seed)
  rows = []
  for prompt, texts in zip(prompts, completions):
    rewards = [float(gold_reward(prompt, t)) for t in texts]
    pairs = list(itertools.combinations(range(len(texts)), 2))
    if max_pairs_per_prompt is not None and len(pairs) > max_pairs_per_prompt:
      keep = rng.choice(len(pairs), size=max_pairs_per_prompt, replace=False)
      pairs = [pairs[i] for i in sorted(keep)]
    for a, b in pairs:
      p_a = preference_probability(rewards[a], rewards[b], beta)
      if rng.random() >= p_a:
        a, b = b, a
      rows.append({"prompt": prompt, "chosen": texts[a], "rejected": texts[b],
                   "chosen_gold_reward": rewards[a],
                   "rejected_gold_reward": rewards[b]})
  return rows


def label_trajectories(prompts: Sequence[str],
                       completions: Sequence[Sequence[str]],
                       gold_reward: GoldReward) -> List[Dict[str, object]]:
  """Single trajectories {"prompt", "completion", "reward": r*}."""
  _check_inputs(prompts, completions, 0.0)
  return [{"prompt": prompt, "completion": text,
           "reward": float(gold_reward(prompt, text))}
          for prompt, texts in zip(prompts, completions) for text in texts]


def label_rankings(prompts: Sequence[str],
                   completions: Sequence[Sequence[str]],
                   gold_reward: GoldReward, *, beta: float, seed: int
                   ) -> List[Dict[str, object]]:
  """Plackett-Luce rankings {"prompt", "completions" best first,
  "gold_rewards"} with weights exp(beta * r*)."""
  _check_inputs(prompts, completions, beta)
  rng = np.random.default_rng(seed)
  rows = []
  for prompt, texts in zip(prompts, completions):
    rewards = np.array([float(gold_reward(prompt, t)) for t in texts])
    # Gumbel-max: sorting utility + Gumbel noise samples Plackett-Luce; with
    # beta=inf the noise only breaks ties.
    noise = rng.gumbel(size=len(texts))
    if math.isinf(beta):
      order = np.lexsort((noise, -rewards))  # By reward; noise breaks ties.
    else:
      order = np.argsort(-(beta * rewards + noise), kind="stable")
    rows.append({"prompt": prompt,
                 "completions": [texts[i] for i in order],
                 "gold_rewards": [float(rewards[i]) for i in order]})
  return rows


def write_jsonl(rows: Sequence[Dict[str, object]], path: str) -> int:
  """Writes rows as JSON lines (any tf.io.gfile path); returns the count."""
  with tf.io.gfile.GFile(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return len(rows)


def write_synthetic_feedback(path: str, kind: str, prompts: Sequence[str],
                             completions: Sequence[Sequence[str]],
                             gold_reward: GoldReward, *, beta: float = math.inf,
                             seed: int = 0, **kwargs) -> int:
  """Labels completions as `kind` ("pairs", "trajectory", "ranking") and
  writes them to `path` in the "columns" layout; returns the row count."""
  if kind == "pairs":
    rows = label_pairs(prompts, completions, gold_reward, beta=beta,
                       seed=seed, **kwargs)
  elif kind == "trajectory":
    rows = label_trajectories(prompts, completions, gold_reward, **kwargs)
  elif kind == "ranking":
    rows = label_rankings(prompts, completions, gold_reward, beta=beta,
                          seed=seed, **kwargs)
  else:
    raise ValueError(f"write_synthetic_feedback: kind {kind!r}; expected "
                     "'pairs', 'trajectory' or 'ranking'.")
  return write_jsonl(rows, path)

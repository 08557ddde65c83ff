"""Best-of-N sampling and rejection-sampling selection (RLHF book ch. 10).

Scores are laid out [num_prompts, n]: n completions per prompt, scored by a
reward model. Best-of-N keeps the top completion of each prompt without
changing the model (book 10.3); rejection sampling keeps the top completion
per prompt or the top K over the whole batch and fine-tunes on them (10.2.2).
"""

import jax
import jax.numpy as jnp

from jaxrlhf import checks


def top_per_prompt(scores):
  """Index of the best completion of each prompt (book 10.2.2.1).

  Args:
    scores: [num_prompts, n].

  Returns:
    [num_prompts] int32 argmax over completions (first one on ties).
  """
  checks.check_rank("top_per_prompt", "scores", scores, 2)
  return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def gather_per_prompt(samples, indices):
  """Picks one completion per prompt.

  Args:
    samples: [num_prompts, n, ...] e.g. tokens [num_prompts, n, length].
    indices: [num_prompts] int, e.g. from `top_per_prompt`.

  Returns:
    [num_prompts, ...] samples[i, indices[i]].
  """
  if samples.shape[:1] != indices.shape:
    raise ValueError(
        f"gather_per_prompt: samples {list(samples.shape)} and indices "
        f"{list(indices.shape)} disagree on num_prompts.")
  return jax.vmap(lambda row, i: row[i])(samples, indices)


def top_k_overall(scores, k):
  """The K best (prompt, completion) pairs of the whole batch (10.2.2.2).

  Args:
    scores: [num_prompts, n].
    k: how many pairs to keep (static Python int, 1 <= k <= num_prompts * n).

  Returns:
    prompt_index: [k] int32.
    completion_index: [k] int32.
    top_scores: [k] in descending order.
  """
  checks.check_rank("top_k_overall", "scores", scores, 2)
  num_prompts, n = scores.shape
  if not 1 <= k <= num_prompts * n:
    raise ValueError(
        f"top_k_overall: k={k} must be between 1 and num_prompts * n = "
        f"{num_prompts * n}.")
  top_scores, flat_index = jax.lax.top_k(scores.reshape(-1), k)
  flat_index = flat_index.astype(jnp.int32)
  return flat_index // n, flat_index % n, top_scores


def best_of_n_kl(n):
  """The analytic KL(best-of-n || base): log n - (n - 1) / n.

  The commonly quoted value (Stiennon et al. 2020, appendix; Hilton & Gao's
  "Measuring Goodhart's law"). Beirami et al. 2024 show it is an upper bound:
  exact when the reward of a sample is continuous (no ties, no atom of
  probability), loose when a few outcomes carry much mass.

  Args:
    n: number of samples (scalar or array, >= 1).

  Returns:
    The KL in nats, same shape as n.
  """
  n = jnp.asarray(n, jnp.float32)
  return jnp.log(n) - (n - 1.0) / n

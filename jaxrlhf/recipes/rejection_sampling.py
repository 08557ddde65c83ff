"""Rejection-sampling fine-tuning, and best-of-N as an evaluation baseline.

RLHF book, chapter 10. Rejection sampling: sample N completions per prompt,
score them with the reward model (with the EOS trick, as the online recipes
do), keep the best of each prompt ("top_per_prompt", 10.2.2.1) or the best K
of the whole batch ("top_k_overall", 10.2.2.2), and fine-tune on the kept
ones with the SFT loss. Here that happens inside every train step: sampling
from the current policy iterates it (each step is a new round on fresh
prompts); `rejection_sampling.sample_from = "reference"` samples from the
frozen SFT model instead, one round as a dataset from it.

Best-of-N (10.3) changes no weights: the SFT policy's best of N samples by
the reward model. `best_of_n_evaluation` judges it like the trained
policies (gold reward, win rate against a reference sample) and reports
the analytic KL(best-of-N || SFT) = log N - (N - 1) / N.
"""

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.eval import evaluation
from jaxrlhf.losses import common
from jaxrlhf.recipes import online
from jaxrlhf.rl import best_of_n as best_of_n_lib
from jaxrlhf.rl import rollout as rollout_lib


class RejectionSamplingRecipe(online.OnlineRecipe):
  default_samples_per_prompt = 8

  def init_trainable(self, rng):
    return {"policy": self.init_lm(rng)}

  def update_rows(self, num_prompts):
    cfg = self.config.rejection_sampling
    if cfg.selection == "top_per_prompt":
      return num_prompts
    return (self.config.train.batch_size if cfg.top_k is None
            else cfg.top_k)

  def _check_rollout_rows(self, config):
    rows = self.update_rows(config.train.batch_size)
    total = self.rollout_rows(config.train.batch_size)
    if not 1 <= rows <= total:
      raise ValueError(
          f"config.rejection_sampling.top_k: {rows} must be between 1 and "
          f"the {total} responses sampled per step.")
    if rows % self.num_minibatches:
      raise ValueError(
          f"config.online.num_minibatches: the {rows} selected responses "
          f"per step do not split into {self.num_minibatches} equal "
          "minibatches.")
    self._check_microbatches(config, rows)

  def sampling_params(self, params, frozen):
    if self.config.rejection_sampling.sample_from == "reference":
      return frozen["reference"]
    return params["policy"]

  def selected_rows(self, scores):
    """Rows of the rollout to fine-tune on. scores: [prompts * N]."""
    n = self.samples_per_prompt
    grouped = scores.reshape(-1, n)
    if self.config.rejection_sampling.selection == "top_per_prompt":
      best = best_of_n_lib.top_per_prompt(grouped)
      return jnp.arange(grouped.shape[0], dtype=jnp.int32) * n + best
    k = self.update_rows(self.config.train.batch_size)
    prompt, completion, _ = best_of_n_lib.top_k_overall(grouped, k)
    return prompt * n + completion

  def update(self, state, rollout, rng):
    rows = self.selected_rows(rollout.scores)
    selected = jax.tree.map(lambda x: jnp.take(x, rows, axis=0),
                            dict(rollout.features,
                                 response_mask=rollout.mask))

    def loss_fn(params, minibatch):
      # SFT on the selection: mean token NLL at temperature 1 (a token
      # mean: micro-batches weigh by tokens, the default `loss_count`).
      logprobs, mask = self.lm.completion_logprobs(params["policy"],
                                                   minibatch)
      nll = -common.masked_mean(logprobs, mask)
      return nll, {"nll": nll}

    params, opt_state, metrics = self.run_updates(state, selected, loss_fn,
                                                  rng)
    kl_coef = state.rl["kl_coef"]
    metrics.update(rollout_lib.rollout_metrics(
        rollout, kl_coef, self.config.online.kl_estimator))
    metrics.update(
        selected_score=jnp.mean(jnp.take(rollout.scores, rows)),
        selected_length=jnp.mean(jnp.sum(jnp.take(rollout.mask, rows, axis=0),
                                         axis=-1)))
    return params, opt_state, state.rl, metrics


def best_of_n_evaluation(recipe: online.OnlineRecipe, state,
                         n: int) -> Dict[str, float]:
  """Best-of-n of the policy (by the reward model), judged by gold reward.

  For each held-out prompt and each of `eval.num_samples` draws: n policy
  samples at `eval.temperature`, the one the reward model scores highest
  (EOS trick applied) against the reference's sample of
  `compare_with_reference` (same seeds, so the rows of a results table
  share their reference completions).

  Returns:
    "eval/..." metrics as the policy recipes report them; "eval/kl" is the
    analytic log n - (n - 1) / n (an upper bound, exact for continuous
    rewards: Beirami et al. 2024).
  """
  cfg = recipe.config
  prompts = recipe._eval_prompts()  # pylint: disable=protected-access
  if prompts is None:
    raise ValueError(f"best-of-N needs a gold reward for "
                     f"{cfg.eval.task or cfg.data.task!r}.")
  tokens, texts, gold = prompts
  policy, reference = state.params["policy"], state.frozen["reference"]
  outcomes, rewards, ref_rewards, lengths, proxy = [], [], [], [], []
  for k in range(cfg.eval.num_samples):
    candidates = [evaluation.sample(
        recipe, policy, tokens, greedy=False, temperature=cfg.eval.temperature,
        seed=cfg.seed + 7919 * (k + 1) + j) for j in range(n)]
    scores = np.stack([recipe.reward_scores(state.frozen["reward"], tokens, s)
                       for s in candidates], axis=1)  # [prompts, n]
    best = np.asarray(best_of_n_lib.top_per_prompt(jnp.asarray(scores)))
    chosen = jax.tree.map(
        lambda *xs: np.stack(xs, axis=1)[np.arange(len(best)), best],
        *candidates)
    theirs = evaluation.sample(recipe, reference, tokens, greedy=False,
                               temperature=cfg.eval.temperature,
                               seed=cfg.seed + 2 * k + 1)
    r = evaluation.gold_rewards(
        gold, texts, evaluation.completion_texts(recipe.vocabulary, chosen),
        chosen.has_eos)
    r_ref = evaluation.gold_rewards(
        gold, texts, evaluation.completion_texts(recipe.vocabulary, theirs),
        theirs.has_eos)
    outcomes.append((r > r_ref) + 0.5 * (r == r_ref))
    rewards.append(r)
    ref_rewards.append(r_ref)
    lengths.append(np.sum(chosen.mask, -1))
    proxy.append(scores[np.arange(len(best)), best])
  cat = lambda xs: np.concatenate(xs).astype(np.float64)
  outcomes = cat(outcomes)
  count = len(outcomes)
  win = evaluation.global_mean(outcomes.sum(), count)
  second = evaluation.global_mean(np.square(outcomes).sum(), count)
  total = evaluation.global_mean(float(count), 1) * jax.process_count()
  return {
      "eval/win_rate": win,
      "eval/win_rate_stderr": float(np.sqrt(max(second - win ** 2, 0.0)
                                            / max(total - 1, 1))),
      "eval/gold_reward": evaluation.global_mean(cat(rewards).sum(), count),
      "eval/reference_gold_reward": evaluation.global_mean(
          cat(ref_rewards).sum(), count),
      "eval/kl": float(best_of_n_lib.best_of_n_kl(n)),
      "eval/length": evaluation.global_mean(cat(lengths).sum(), count),
      "eval/reward_model_score": evaluation.global_mean(cat(proxy).sum(),
                                                        count),
  }

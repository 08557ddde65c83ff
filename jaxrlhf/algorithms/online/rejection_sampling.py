"""Rejection-sampling fine-tuning, and best-of-N as an evaluation baseline.

RLHF book, chapter 10. Rejection sampling: sample N completions per prompt,
score them with the reward model (with the EOS trick, as the online
algorithms do), keep the best of each prompt ("top_per_prompt", 10.2.2.1) or
the best K of the whole batch ("top_k_overall", 10.2.2.2), and fine-tune on
the kept ones with the SFT loss. Here that happens inside every train step:
sampling from the current policy iterates it (each step is a new round on
fresh prompts); `rejection_sampling.sample_from = "reference"` samples from
the frozen SFT model instead, one round as a dataset from it. A
mixture-of-experts policy's SFT loss routes the kept samples afresh (no
router replay): replay keeps the sampler's and the trainer's log-probs of
one token equal for an importance ratio, and the SFT loss has none.

Best-of-N (10.3) changes no weights: the SFT policy's best of N samples by
the reward model. `best_of_n_evaluation` judges it like the trained
policies (gold reward, win rate against a reference sample) and reports
the analytic KL(best-of-N || SFT) = log N - (N - 1) / N.
"""

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import recipe
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import reward_model_eval
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.eval import evaluation
from jaxrlhf.losses import common
from jaxrlhf.rl import best_of_n as best_of_n_lib

F = config_schema.Field

SELECTIONS = ("top_per_prompt", "top_k_overall")
SAMPLE_FROM = ("policy", "reference")

GROUP = config_schema.Group(
    "rejection_sampling", "Rejection-sampling fine-tuning.", [
        F("selection", "top_per_prompt",
          "Which samples are fine-tuned on: 'top_per_prompt' (the best of "
          "each prompt's N) or 'top_k_overall' (the best top_k of the whole "
          "batch).", choices=SELECTIONS),
        F("top_k", None, "top_k_overall's K; unset = train.batch_size.",
          type=int, bounds=">0"),
        F("sample_from", "reference",
          "Sample from the frozen 'reference' (one round: fine-tune on the "
          "best of the SFT model's samples) or from the current 'policy' (a "
          "new round every step; without a KL term it drifts far, as "
          "iterated selection compounds).", choices=SAMPLE_FROM),
    ])


def update_rows(config, num_prompts, num_responses):
  """The responses a step fine-tunes on (of the `num_responses` it
  samples)."""
  cfg = config.rejection_sampling
  if cfg.selection == "top_per_prompt":
    return num_prompts
  rows = config.train.batch_size if cfg.top_k is None else cfg.top_k
  if not 1 <= rows <= num_responses:
    raise ValueError(
        f"config.rejection_sampling.top_k: {rows} must be between 1 and the "
        f"{num_responses} responses sampled per step.")
  return rows


def samples_reference(config) -> bool:
  return config.rejection_sampling.sample_from == "reference"


def sample_params(config, params, frozen):
  if samples_reference(config):
    return frozen["reference"]
  return params["policy"]


def selected_rows(config, scores, samples_per_prompt: int):
  """Rows of the rollout to fine-tune on. scores: [prompts * N]."""
  n = samples_per_prompt
  grouped = scores.reshape(-1, n)
  if config.rejection_sampling.selection == "top_per_prompt":
    best = best_of_n_lib.top_per_prompt(grouped)
    return jnp.arange(grouped.shape[0], dtype=jnp.int32) * n + best
  k = update_rows(config, grouped.shape[0], scores.shape[0])
  prompt, completion, _ = best_of_n_lib.top_k_overall(grouped, k)
  return prompt * n + completion


def targets(trainer, state, rollout):
  """The selected samples, the unchanged carried state, and what was
  selected."""
  rows = selected_rows(trainer.config, rollout.scores,
                       trainer.online.samples_per_prompt)
  selected = jax.tree.map(lambda x: jnp.take(x, rows, axis=0),
                          dict(rollout.features, response_mask=rollout.mask))
  metrics = {
      "selected_score": jnp.mean(jnp.take(rollout.scores, rows)),
      "selected_length": jnp.mean(jnp.sum(jnp.take(rollout.mask, rows,
                                                   axis=0), axis=-1)),
  }
  return selected, state.algorithm_state, metrics


def loss(trainer, params, minibatch, algorithm_state):
  """SFT on the selection: mean token NLL at temperature 1 (a token mean:
  micro-batches weigh by tokens)."""
  del algorithm_state
  logprobs, mask = trainer.lm.completion_logprobs(params["policy"], minibatch)
  nll = -common.masked_mean(logprobs, mask)
  return nll, {"nll": nll}


ALGORITHM = base.Algorithm(
    name="rejection_sampling",
    summary="Rejection-sampling fine-tuning: SFT on the reward model's best "
    "of N samples per prompt (or the best K of a batch).",
    data=base.PROMPTS,
    networks=recipe.POLICY_REFERENCE_AND_REWARD,
    training=recipe.Online(
        samples_per_prompt=8, num_epochs=1, targets=targets, loss=loss,
        update_rows=update_rows, sample_params=sample_params,
        samples_reference=samples_reference),
    evaluation=reward_model_eval.EVALUATION,
    config_groups=(options.ONLINE, reward_sources.GROUP, GROUP),
    checks=(options.check_online,),
    pipeline_stage=True,
)


def best_of_n_evaluation(trainer, state, n: int) -> Dict[str, float]:
  """Best-of-n of the policy (by the reward model), judged against the
  reference by config.eval.judge.

  For each held-out prompt and each of `eval.num_samples` draws: n policy
  samples at `eval.temperature`, the one the reward model scores highest
  (EOS trick applied) against the reference's sample of
  `compare_with_reference` (same seeds, so the rows of a results table
  share their reference completions).

  Returns:
    "eval/..." metrics as the policy algorithms report them; "eval/kl" is the
    analytic log n - (n - 1) / n (an upper bound, exact for continuous
    rewards: Beirami et al. 2024).
  """
  cfg = trainer.config
  prompts = policy_eval.eval_prompts(trainer)
  if prompts is None:
    raise ValueError(f"best-of-N needs a judge: "
                     f"{cfg.eval.task or cfg.data.task!r} has no gold reward "
                     "(set config.eval.judge).")
  tokens, texts, judge = prompts
  policy, reference_params = (state.params["policy"],
                              trainer.reference_params(state))
  outcomes, judged, lengths, proxy = [], {}, [], []
  for k in range(cfg.eval.num_samples):
    candidates = [evaluation.sample(
        trainer, policy, tokens, greedy=False,
        temperature=cfg.eval.temperature,
        seed=cfg.seed + 7919 * (k + 1) + j) for j in range(n)]
    scores = np.stack([reward_sources.reward_scores(
        trainer, state.frozen["reward"], tokens, s)
                       for s in candidates], axis=1)  # [prompts, n]
    best = np.asarray(best_of_n_lib.top_per_prompt(jnp.asarray(scores)))
    chosen = jax.tree.map(
        lambda *xs: np.stack(xs, axis=1)[np.arange(len(best)), best],
        *candidates)
    theirs = evaluation.sample(trainer, reference_params, tokens, greedy=False,
                               temperature=cfg.eval.temperature,
                               seed=cfg.seed + 2 * k + 1)
    outcome, values = judge(trainer, tokens, texts, chosen, theirs)
    outcomes.append(outcome)
    for name, value in values.items():
      judged.setdefault(name, []).append(value)
    lengths.append(np.sum(chosen.mask, -1))
    proxy.append(scores[np.arange(len(best)), best])
  cat = lambda xs: np.concatenate(xs).astype(np.float64)
  count = sum(len(o) for o in outcomes)
  metrics = evaluation.judged_metrics(outcomes, judged)
  metrics.update({
      "eval/kl": float(best_of_n_lib.best_of_n_kl(n)),
      "eval/length": evaluation.global_mean(cat(lengths).sum(), count),
      "eval/reward_model_score": evaluation.global_mean(cat(proxy).sum(),
                                                        count),
  })
  return metrics

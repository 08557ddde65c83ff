"""A policy judged against the policy it started from.

Policy algorithms (the DPO family, KTO, BCO, DRO-V and the online ones)
evaluate by sampling completions from the policy and from its reference on
held-out prompts of `config.eval.task`, and report the win rate against the
reference, as a judge decides it, KL(policy || reference) and mean length
(`jaxrlhf.eval.evaluation.compare_with_reference`). The judge is
`config.eval.judge` (`jaxrlhf.eval.judges`: the gold reward, a reward
model, or your pairwise function, e.g. an LLM); a task of an alignment kind
(such as the run's own files) gives its distinct prompts. Algorithms that
train on pairs are also scored on held-out pairs (data.files.validation) by
the accuracy of their implicit reward (PPO details, detail 19).

The reference is the run's frozen copy of the starting policy, or, for a
run that keeps none (precomputed reference log-probs, reference-free
losses) or changes its copy (TR-DPO), the starting policy loaded while the
evaluation runs (`Trainer.reference_params`).
"""

from typing import Dict

import jax
import numpy as np

from jaxrlhf import console
from jaxrlhf import run_cache
from jaxrlhf.algorithms import base
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.eval import evaluation
from jaxrlhf.eval import judges
from jaxrlhf.eval import pair_metrics
from jaxrlhf.models import scoring




def eval_prompts(trainer, split: str = ""):
  """(prompt tokens [n, Lp], prompt texts, judge) of the held-out prompts of
  config.eval.task's `split` (default config.eval.split), read once per run,
  or None when nothing can judge them (the gold reward judges and the task
  has none). A task with `inputs` (SFT-style) gives its first
  eval.num_examples examples' inputs; a task of an alignment kind its first
  eval.num_examples distinct prompts."""
  return _read_eval_prompts(trainer, split or trainer.config.eval.split)


@run_cache.per_run
def _read_eval_prompts(trainer, split: str):
  # The data stack loads here, where the data is read, not with the config.
  import seqio  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  task = cfg.eval.task or cfg.data.task
  judge = judges.make_judge(trainer.config, task)
  if judge is None:
    return None
  if "inputs" in pipeline.get_task(task).output_features:
    features, texts = pipeline.eval_examples(
        task, split, {"inputs": trainer.prompt_length,
                      "targets": cfg.data.targets_length},
        seqio.EncDecFeatureConverter(pack=False), cfg.eval.num_examples)
    return (features["encoder_input_tokens"], [t["inputs"] for t in texts],
            judge)
  tokens, texts = prompts_lib.held_out_prompts(
      task, split, trainer.prompt_length, cfg.eval.num_examples)
  return tokens, texts, judge


def check_eval_task(trainer) -> None:
  """The judge must be able to work (`judges.check`); a named eval task must
  exist and, judged by the gold reward, have one; without any judge the run
  says once that it will not judge the policy."""
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  if cfg.eval.task:
    pipeline.get_task(cfg.eval.task, field="config.eval.task")
  if cfg.eval.judge != "gold_reward":
    judges.check(trainer)
  elif cfg.eval.task:
    if tasks.gold_reward_for(cfg.eval.task) is None:
      raise ValueError(
          f"config.eval.task: {cfg.eval.task!r} has no gold reward, which "
          "policy evaluation judges samples with (config.eval.judge "
          "'gold_reward'). Register one with "
          "jaxrlhf.data.tasks.register_gold_reward, use a task that has one "
          "(e.g. 'synthetic_summarize'), judge with a reward model or your "
          "own function (config.eval.judge), or set it to '' to train "
          "without evaluation.")
  elif tasks.gold_reward_for(cfg.data.task) is None:
    console.log(
        f"No evaluation: config.data.task {cfg.data.task!r} has no gold "
        "reward to judge the policy with; set config.eval.task to a task "
        "that has one (e.g. 'synthetic_summarize'), or config.eval.judge to "
        "'reward_model' or 'function', to evaluate.")


def against_reference(trainer, state, split: str = "") -> Dict[str, float]:
  """Win rate against the reference and the other headline numbers, on
  `split` (default config.eval.split); for algorithms that train on pairs,
  also the held-out accuracy of their implicit reward
  (`implicit_reward_metrics`)."""
  prompts = eval_prompts(trainer, split)
  pairs = (trainer.algorithm.data == "pairs"
           and not split and eval_split_features(trainer) is not None)
  if prompts is None and not pairs:
    return {}
  state = trainer.view(state)  # a LoRA run's policy: base and adapters
  reference_params = trainer.reference_params(state)
  metrics = {}
  if prompts is not None:
    tokens, texts, judge = prompts
    e = trainer.config.eval
    metrics = evaluation.compare_with_reference(
        trainer, state.params["policy"], reference_params, tokens, texts,
        judge, num_samples=e.num_samples, temperature=e.temperature,
        seed=trainer.config.seed, num_folds=e.num_folds)
  if pairs:
    metrics.update(implicit_reward_metrics(trainer, state.params["policy"],
                                           reference_params))
  return metrics


def describe_against_reference(config) -> str:
  e = config.eval
  text = (f"{e.num_examples} held-out prompts x {e.num_samples} samples at "
          f"temperature {e.temperature:g}, against the reference's")
  if e.judge != "gold_reward":
    task = e.task or config.data.task
    text += f", {judges.make_judge(config, task).describe()}"
  if e.num_folds > 1:
    text += f", in {e.num_folds} folds"
  return text


AGAINST_REFERENCE = base.Evaluation(evaluate=against_reference,
                                    describe=describe_against_reference,
                                    check=check_eval_task)


# --- held-out pairs: the implicit reward (PPO details, detail 19) -------------------


@run_cache.per_run
def eval_split_features(trainer):
  """This process's features of the first eval.num_examples examples of
  config.data.task's config.data.eval_split (data.files.validation), laid
  out as the run's training batches (held-out pairs, rankings), read once;
  None when the task has no such split."""
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  try:
    features, _ = pipeline.eval_examples(
        cfg.data.task, cfg.data.eval_split, trainer.feature_lengths,
        trainer.feature_converter, cfg.eval.num_examples)
  except (ValueError, KeyError, StopIteration):
    return None
  return features


@run_cache.per_run
def _pair_scorer(trainer):
  """The compiled scorer of held-out pairs' log-probs."""
  return jax.jit(lambda p, b: scoring.sequence_logprobs(
      trainer.lm, p, b, ("chosen", "rejected")))


def _pair_logprobs(trainer, params, features) -> Dict[str, np.ndarray]:
  """{"chosen", "rejected": [n] log pi(completion | prompt)} of this
  process's held-out pairs."""
  score = _pair_scorer(trainer)
  n = len(next(iter(features.values())))
  parts = [jax.tree.map(evaluation.local_rows, score(params, b))
           for b in evaluation.global_batches(
               features, trainer.config.eval.batch_size, trainer.mesh,
               trainer.rules)]
  return jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *parts)


@run_cache.per_run
def _reference_pair_logprobs(trainer, *, reference_params, features):
  """The reference's `_pair_logprobs`, computed once: it never changes."""
  return _pair_logprobs(trainer, reference_params, features)


def implicit_reward_metrics(trainer, policy, reference_params
                            ) -> Dict[str, float]:
  """DPO's implicit reward on held-out pairs ("N+ implementation details",
  detail 19): r(x, y) = log pi(y | x) - log pi_ref(y | x) (DPO's reward up
  to its beta, which does not change which completion it prefers).
  eval/implicit_reward_accuracy is the share of pairs whose chosen
  completion gets the higher reward (ties 1/2: exactly 0.5 while the policy
  is its reference), eval/implicit_reward_margin the mean difference, and
  the accuracy by annotation batch and confidence
  (`jaxrlhf.eval.pair_metrics`)."""
  features = eval_split_features(trainer)
  if features is None:
    return {}
  ref = _reference_pair_logprobs(trainer, reference_params=reference_params,
                                 features=features)
  pi = _pair_logprobs(trainer, policy, features)
  return pair_metrics.pair_metrics(
      pi["chosen"] - ref["chosen"], pi["rejected"] - ref["rejected"],
      features, "implicit_reward",
      pair_metrics.confidence_scale(trainer.config.data.task))

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
the accuracy of their implicit reward (PPO details, detail 19). Online
runs are also scored on held-out prompts by their own host rewards
(`eval.with_rewards`: greedy pass@1, mean@n and pass@k,
`jaxrlhf.eval.pass_at_k`), which is how a run on a file task with a math
verifier (GSM8K) reports held-out accuracy: nothing else judges it there.

The reference is the run's frozen copy of the starting policy, or, for a
run that keeps none (precomputed reference log-probs, reference-free
losses) or changes its copy (TR-DPO), the starting policy loaded while the
evaluation runs (`Trainer.reference_params`).
"""

from typing import Dict, List

import jax
import numpy as np

from jaxrlhf import console
from jaxrlhf import run_cache
from jaxrlhf.algorithms import base
from jaxrlhf.agents import environments
from jaxrlhf.algorithms.online import episode_step
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.eval import evaluation
from jaxrlhf.eval import judges
from jaxrlhf.eval import pair_metrics
from jaxrlhf.eval import pass_at_k
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
  exist and, judged by the gold reward, have one, unless the run's own
  rewards score it (`scores_with_rewards`); eval.with_rewards 'on' must be
  able to work; without any judge the run says once that it will not judge
  the policy."""
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  if cfg.eval.task:
    pipeline.get_task(cfg.eval.task, field="config.eval.task")
  _check_with_rewards(cfg)
  if cfg.eval.judge != "gold_reward":
    judges.check(trainer)
  elif scores_with_rewards(cfg):
    pass  # the run's rewards judge; a gold reward, where there is one, too
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
    rewards = (f"; or give it a {cfg.eval.split!r} split (e.g. "
               "config.data.files.validation) for the run's own rewards to "
               "score (config.eval.with_rewards)"
               if cfg.eval.with_rewards == "auto" and _host_reward_names(cfg)
               else "")
    console.log(
        f"No evaluation: config.data.task {cfg.data.task!r} has no gold "
        "reward to judge the policy with; set config.eval.task to a task "
        "that has one (e.g. 'synthetic_summarize'), or config.eval.judge to "
        f"'reward_model' or 'function', to evaluate{rewards}.")


def against_reference(trainer, state, split: str = "") -> Dict[str, float]:
  """Win rate against the reference and the other headline numbers, on
  `split` (default config.eval.split); for algorithms that train on pairs,
  also the held-out accuracy of their implicit reward
  (`implicit_reward_metrics`)."""
  prompts = eval_prompts(trainer, split)
  pairs = (trainer.algorithm.data == "pairs"
           and not split and eval_split_features(trainer) is not None)
  rewards = trainer.online is not None and scores_with_rewards(
      trainer.config, split)
  if prompts is None and not pairs and not rewards:
    return {}
  state = trainer.view(state)  # a LoRA run's policy: base and adapters
  metrics = {}
  if prompts is not None or pairs:
    reference_params = trainer.reference_params(state)
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
  if rewards:
    metrics.update(held_out_reward_metrics(trainer, state.params["policy"],
                                           split))
  return metrics


def describe_against_reference(config) -> str:
  e = config.eval
  task = e.task or config.data.task
  parts = []
  if e.judge != "gold_reward" or judges.make_judge(config, task) is not None:
    text = (f"{e.num_examples} held-out prompts x {e.num_samples} samples "
            f"at temperature {e.temperature:g}, against the reference's")
    if e.judge != "gold_reward":
      text += f", {judges.make_judge(config, task).describe()}"
    if e.num_folds > 1:
      text += f", in {e.num_folds} folds"
    parts.append(text)
  if scores_with_rewards(config):
    parts.append(describe_reward_metrics(config))
  return "; ".join(parts)


AGAINST_REFERENCE = base.Evaluation(evaluate=against_reference,
                                    describe=describe_against_reference,
                                    check=check_eval_task)


# --- held-out prompts scored by the run's own rewards (eval.with_rewards) -----------


def _host_reward_names(config) -> List[str]:
  """The names of the run's host rewards when its algorithm is online (the
  ones held-out prompts are scored with), else []."""
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  if not algorithms.get(config.algorithm).online:
    return []
  return [name for name in reward_sources.weights(config)
          if name not in reward_sources.DEVICE_REWARDS]


def _has_split(config, split: str) -> bool:
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  return split in pipeline.get_task(config.eval.task
                                    or config.data.task).splits


def scores_with_rewards(config, split: str = "") -> bool:
  """Whether held-out prompts of `split` (default eval.split) are scored by
  the run's host rewards (config.eval.with_rewards: 'auto' where the run
  has host rewards, nothing else judges its policy and the split exists)."""
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  e = config.eval
  if e.with_rewards == "off" or not _host_reward_names(config):
    return False
  if e.with_rewards == "on":
    return True
  no_judge = (e.judge == "gold_reward" and tasks.gold_reward_for(
      e.task or config.data.task) is None)
  return no_judge and _has_split(config, split or e.split)


def _check_with_rewards(cfg) -> None:
  """eval.with_rewards 'on' needs an online run with host rewards and the
  split to score (`cfg`: the run's config)."""
  if cfg.eval.with_rewards != "on":
    return
  if not _host_reward_names(cfg):
    raise ValueError(
        "config.eval.with_rewards: 'on' scores held-out prompts with the "
        "run's host rewards, and this run has none "
        f"({cfg.algorithm!r}: only online algorithms have rewards, and "
        "config.rewards weights no math_answer, format, code, functions or "
        "gold_reward); weight one, or set it to 'auto' or 'off'.")
  if not _has_split(cfg, cfg.eval.split):
    raise ValueError(
        f"config.eval.split: task {cfg.eval.task or cfg.data.task!r} has no "
        f"split {cfg.eval.split!r} for config.eval.with_rewards 'on' to "
        "score; give it one (config.data.files.validation or .test, then "
        "--config.eval.split=test) or name one it has.")


@run_cache.per_run
def _reward_eval_prompts(trainer, split: str):
  """This process's share of the first eval.num_examples prompts of
  eval.task's `split`, fitted as the run's training prompts are
  (online.long_prompts, online.prompt_suffix), read once per run: (tokens
  [n, Lp] int32, their texts [n], their extra columns {name: [n]})."""
  cfg = trainer.config
  read = prompts_lib.load_prompts(
      cfg.eval.task or cfg.data.task, split, trainer.prompt_length,
      on_long=cfg.online.long_prompts, suffix=cfg.online.prompt_suffix)
  # Every process reads the whole split; process p takes the p-th block.
  share = min(cfg.eval.num_examples, len(read.texts)) // jax.process_count()
  rows = slice(jax.process_index() * share,
               (jax.process_index() + 1) * share)
  return (read.tokens[rows], read.texts[rows],
          {name: list(values[rows]) for name, values in read.columns.items()})


def held_out_reward_metrics(trainer, policy, split: str = ""
                            ) -> Dict[str, float]:
  """eval/pass@1, eval/mean@n, eval/pass@k and each host reward's mean
  (`pass_at_k.reward_metrics`; a run of episodes: of its episodes,
  `episode_step.held_out_metrics`) of the policy's completions of the held-out
  prompts of `split` (default eval.split): a greedy completion and
  eval.samples_per_prompt sampled at eval.temperature per prompt, of at
  most online.max_new_tokens tokens as in training, scored by the run's
  host rewards (`RewardSources.score_on_host`) with their weights."""
  cfg, e = trainer.config, trainer.config.eval
  tokens, texts, columns = _reward_eval_prompts(trainer, split or e.split)
  if environments.episodic(cfg.online):  # episodes, not responses
    return episode_step.held_out_metrics(
        trainer, policy, texts, columns, n=e.samples_per_prompt,
        temperature=e.temperature, seed=cfg.seed,
        threshold=e.pass_threshold,
        ks=pass_at_k.parse_ks(e.pass_k, e.samples_per_prompt))
  sources = trainer.online.rewards
  # The columns score_on_host gives: the rewards computed from text.
  names = [reward.name for reward in sources.host]
  max_new_tokens = trainer.online.max_new_tokens

  def scored(samples, prompt_texts, prompt_columns) -> np.ndarray:
    """[rows, num host rewards], NaN where a reward does not apply."""
    values, _ = sources.score_on_host(
        cfg, prompt_texts, evaluation.completion_texts(trainer.vocabulary,
                                                       samples),
        samples.has_eos, prompt_columns)
    return values

  greedy = scored(evaluation.sample(trainer, policy, tokens, greedy=True,
                                    max_new_tokens=max_new_tokens),
                  texts, columns)
  n = e.samples_per_prompt
  sampled = np.zeros((len(tokens), 0, len(names)), np.float32)
  if n:
    # Each prompt n times in a row: its samples are rows [i * n, (i+1) * n).
    repeat = lambda values: [v for v in values for _ in range(n)]
    samples = evaluation.sample(
        trainer, policy, np.repeat(tokens, n, axis=0), greedy=False,
        temperature=e.temperature, seed=cfg.seed,
        max_new_tokens=max_new_tokens)
    sampled = scored(samples, repeat(texts),
                     {k: repeat(v) for k, v in columns.items()}).reshape(
                         len(tokens), n, len(names))
  return pass_at_k.reward_metrics(
      greedy, sampled, names, [sources.weights[name] for name in names],
      e.pass_threshold, pass_at_k.parse_ks(e.pass_k, n))


def describe_reward_metrics(config) -> str:
  """"8 held-out prompts of split 'test', scored by math_answer x 1 +
  format x 0.1 (pass: >= 1): greedy, and 4 samples at temperature 1"."""
  e = config.eval
  weights = reward_sources.weights(config)
  total = " + ".join(f"{name} x {weights[name]:g}"
                     for name in _host_reward_names(config))
  text = (f"{e.num_examples} held-out prompts of split {e.split!r}, scored "
          f"by {total} (pass: >= {e.pass_threshold:g}): greedy")
  if e.samples_per_prompt:
    text += (f", and {e.samples_per_prompt} samples at temperature "
             f"{e.temperature:g}")
  return text


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

"""Judges of side-by-side comparisons: which of two completions is better.

The DRO paper judges a policy against its SFT reference side by side, with
an LLM as the judge (section 4); the PPO implementation-details paper does
the same against reference summaries with GPT-3.5, putting the two in a
random order to remove position bias (its appendix I). `config.eval.judge`
picks the judge of a run's evaluation:

  "gold_reward"   the task's gold reward (`tasks.register_gold_reward`): the
                  completion with the higher reward wins. Exact, for tasks
                  that have one (the built-in synthetic task).
  "reward_model"  a trained reward model (`eval.judge_checkpoint`, a
                  reward_model run): the higher score wins. A reward model's
                  score is only defined at an EOS (PPO details 12-13), so a
                  completion that never ends loses to one that does (two
                  that never end tie).
  "function"      your pairwise judge (`eval.judge_function`, imported by
                  its path "package.module:function" or
                  "package.module.function"), e.g. one that asks an LLM:

                    def judge(prompts, first, second) -> Sequence[float]:
                      # P(first is better than second) in [0, 1], one per
                      # prompt; 0.5 is a tie.

                  The policy's completion is `first` on even prompts and
                  `second` on odd ones, so a judge that prefers a position
                  favours neither side.

A judge turns (prompts, policy samples, reference samples) into one outcome
per prompt in [0, 1] (1: the policy wins; ties 1/2) and optional per-sample
values the evaluation averages (e.g. the gold rewards of both sides).
"""

import dataclasses
import functools
import importlib
from typing import Callable, Dict, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import run_cache
from jaxrlhf import sharding
from jaxrlhf.eval import evaluation
from jaxrlhf.models import heads
from jaxrlhf.models import pretrained
from jaxrlhf.rewards import learned_reward
from jaxrlhf.rl import rollout as rollout_lib

JUDGES = ("gold_reward", "reward_model", "function")

# (outcomes [n] in [0, 1], {metric: [n] values to average, or (sums, counts)})
Judgement = Tuple[np.ndarray, Dict[str, np.ndarray]]


def wins(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
  """1 where `mine` is higher, 1/2 on ties, 0 where it is lower."""
  return (mine > theirs) + 0.5 * (mine == theirs)


def score_outcomes(scores: np.ndarray, reference_scores: np.ndarray,
                   ended: np.ndarray, reference_ended: np.ndarray
                   ) -> np.ndarray:
  """Outcomes of comparisons by a score that is only defined at an EOS: the
  higher score wins when both completions end; a completion that ends beats
  one that does not; two that never end tie."""
  ended = np.asarray(ended, bool)
  reference_ended = np.asarray(reference_ended, bool)
  return np.where(ended & reference_ended, wins(scores, reference_scores),
                  wins(ended.astype(np.float64),
                       reference_ended.astype(np.float64)))


@dataclasses.dataclass(frozen=True)
class GoldReward:
  """The task's gold reward judges; the rewards themselves are reported."""
  gold: Callable[[str, str, bool], float]

  def describe(self) -> str:
    return "judged by the gold reward"

  def __call__(self, trainer, prompt_tokens, prompts, mine, theirs
               ) -> Judgement:
    del prompt_tokens
    r = evaluation.gold_rewards(
        self.gold, prompts, evaluation.completion_texts(trainer.vocabulary,
                                                        mine), mine.has_eos)
    r_ref = evaluation.gold_rewards(
        self.gold, prompts, evaluation.completion_texts(trainer.vocabulary,
                                                        theirs),
        theirs.has_eos)
    return wins(r, r_ref), {"eval/gold_reward": r,
                            "eval/reference_gold_reward": r_ref}


@dataclasses.dataclass(frozen=True)
class RewardModel:
  """A reward model's scores judge (see the module docstring)."""
  path: str

  def describe(self) -> str:
    return f"judged by the reward model {self.path}"

  def __call__(self, trainer, prompt_tokens, prompts, mine, theirs
               ) -> Judgement:
    del prompts
    adapter, params = reward_model(trainer, self.path)
    s = _scores(trainer, adapter, params, prompt_tokens, mine)
    s_ref = _scores(trainer, adapter, params, prompt_tokens, theirs)
    ended, ended_ref = np.asarray(mine.has_eos), np.asarray(theirs.has_eos)
    return score_outcomes(s, s_ref, ended, ended_ref), {
        "eval/judge_reward": (np.where(ended, s, 0.0), ended),
        "eval/reference_judge_reward": (np.where(ended_ref, s_ref, 0.0),
                                        ended_ref)}


@dataclasses.dataclass(frozen=True)
class Function:
  """Your pairwise judge, with the policy first on even prompts."""
  path: str

  def describe(self) -> str:
    return f"judged by {self.path}"

  def __call__(self, trainer, prompt_tokens, prompts, mine, theirs
               ) -> Judgement:
    del prompt_tokens
    fn = import_judge(self.path)
    a = evaluation.completion_texts(trainer.vocabulary, mine)
    b = evaluation.completion_texts(trainer.vocabulary, theirs)
    policy_first = np.arange(len(prompts)) % 2 == 0
    first = [x if f else y for x, y, f in zip(a, b, policy_first)]
    second = [y if f else x for x, y, f in zip(a, b, policy_first)]
    try:
      p = np.asarray(fn(list(prompts), first, second), np.float64)
    except Exception as e:  # pylint: disable=broad-except
      raise RuntimeError(
          f"config.eval.judge_function: {self.path} failed on "
          f"{len(prompts)} prompts: {type(e).__name__}: {e}") from e
    if p.shape != (len(prompts),) or not np.all((p >= 0) & (p <= 1)):
      raise ValueError(
          f"config.eval.judge_function: {self.path} must return one "
          f"probability in [0, 1] per prompt ({len(prompts)}), got shape "
          f"{p.shape} with values in [{np.min(p, initial=np.nan):g}, "
          f"{np.max(p, initial=np.nan):g}].")
    return np.where(policy_first, p, 1.0 - p), {}


# --- construction and start-up checks -----------------------------------------


def import_judge(path: str) -> Callable:
  """The function named "pkg.module:fn" or "pkg.module.fn"."""
  module_name, sep, attribute = path.partition(":")
  if not sep:
    module_name, _, attribute = path.rpartition(".")
  if not module_name or not attribute:
    raise ValueError(
        f"config.eval.judge_function: {path!r} is not an import path; write "
        "'package.module:function'.")
  try:
    fn = getattr(importlib.import_module(module_name), attribute)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"config.eval.judge_function: cannot import {path!r} "
                     f"({type(e).__name__}: {e}).") from None
  if not callable(fn):
    raise ValueError(f"config.eval.judge_function: {path!r} is not callable.")
  return fn


def make_judge(config, task: str):
  """The judge config.eval.judge names, for prompts of `task`; None when the
  gold reward judges and `task` has none."""
  e = config.eval
  if e.judge == "reward_model":
    return RewardModel(e.judge_checkpoint)
  if e.judge == "function":
    return Function(e.judge_function)
  # The task registry (seqio) loads with the data, not with the config.
  from jaxrlhf.data import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
  gold = tasks_lib.gold_reward_for(task)
  return GoldReward(gold) if gold is not None else None


def check(trainer) -> None:
  """Refuses, before anything is written, a judge that cannot work."""
  e = trainer.config.eval
  if e.judge == "reward_model":
    if not e.judge_checkpoint:
      raise ValueError("config.eval.judge_checkpoint: eval.judge is "
                       "'reward_model'; set it to a reward_model run's "
                       "workdir.")
    run = pretrained.run_config(e.judge_checkpoint)
    if run is None:
      raise ValueError(
          f"config.eval.judge_checkpoint: {e.judge_checkpoint!r} has no "
          "config.json; point it at a jaxrlhf reward_model run's workdir.")
    learned_reward.build(e.judge_checkpoint, "config.eval.judge_checkpoint",
                         trainer.vocabulary, trainer.config.model,
                         trainer.platform)
  elif e.judge == "function":
    if not e.judge_function:
      raise ValueError("config.eval.judge_function: eval.judge is "
                       "'function'; name your judge, e.g. "
                       "'my_pkg.judges:compare'.")
    import_judge(e.judge_function)


# --- the reward model judge -------------------------------------------------------


@run_cache.per_run
def reward_model(trainer, path: str):
  """(scoring adapter, params) of the reward model at `path`, loaded once
  per run, in its own run's architecture and size."""
  network = learned_reward.build(path, "config.eval.judge_checkpoint",
                                 trainer.vocabulary, trainer.config.model,
                                 trainer.platform)
  module, module_config = network.adapter.module, network.model_config
  adapter = network.adapter
  abstract = jax.eval_shape(
      lambda rng: heads.init_from_backbone(
          rng, trainer.init_lm(rng, module=module), module_config.emb_dim),
      jax.random.PRNGKey(0))
  shardings = sharding.tree_shardings(abstract, trainer.mesh, trainer.rules)
  is_boxed = lambda x: isinstance(x, nn.LogicallyPartitioned)
  shapes = jax.tree.map(lambda x: x.value if is_boxed(x) else x, abstract,
                        is_leaf=is_boxed)
  target = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      shapes, shardings)
  try:
    params = pretrained.load_network_params(path, target, "reward")
  except ValueError as e:
    raise ValueError(f"config.eval.judge_checkpoint: {e}") from None
  return adapter, params


@functools.lru_cache(maxsize=None)
def _score_fn(adapter):
  return jax.jit(lambda params, batch: heads.sequence_rewards(adapter, params,
                                                              batch))


def _scores(trainer, adapter, params, prompt_tokens, samples) -> np.ndarray:
  """[n] reward-model scores of sampled completions (read at their last
  token; only those with an EOS are used)."""
  features = jax.tree.map(np.asarray, rollout_lib.response_features(
      adapter, jnp.asarray(prompt_tokens), jnp.asarray(samples.tokens),
      jnp.asarray(samples.mask), trainer.vocabulary.eos_id))
  n = len(prompt_tokens)
  score = _score_fn(adapter)
  return np.concatenate([
      evaluation.local_rows(score(params, b))
      for b in evaluation.global_batches(
          features, trainer.config.eval.batch_size, trainer.mesh,
          trainer.rules)])[:n].astype(np.float64)

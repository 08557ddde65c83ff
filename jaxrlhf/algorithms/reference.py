"""A policy trained against a frozen reference, and judged against it.

The policy and the reference both start from `config.init.policy_checkpoint`
(normally the SFT run); the reference stays fixed and is checkpointed with
the run. Evaluation samples completions from both on held-out prompts of
`config.eval.task` and reports the win rate against the reference, as a
judge decides it, KL(policy || reference) and mean length
(`jaxrlhf.eval.evaluation.compare_with_reference`). The judge is
`config.eval.judge` (`jaxrlhf.eval.judges`: the gold reward, a reward
model, or your pairwise function, e.g. an LLM); a task of an alignment kind
(such as the run's own files) gives its distinct prompts. Algorithms that
train on pairs are also scored on held-out pairs (data.files.validation) by
the accuracy of their implicit reward (PPO details, detail 19).

With `config.reference_logprobs.mode = "precomputed"` (algorithms whose loss
reads the reference only through each example's own completions) the
reference is not part of the train state: its log-probs are computed once
over the training split (`reference_cache`) and arrive with each batch, and
evaluation loads the reference from `config.init.policy_checkpoint` only
while it runs. Reference-free losses (SimPO, ORPO) keep no reference either,
and are judged against the policy they started from the same way.
"""

import os
from typing import Dict, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import seqio

from jaxrlhf import config_schema
from jaxrlhf import console
from jaxrlhf import sharding
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import pretrained
from jaxrlhf.algorithms import reference_cache
from jaxrlhf.data import alignment_data
from jaxrlhf.data import pipeline
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data import tasks
from jaxrlhf.eval import evaluation
from jaxrlhf.eval import judges
from jaxrlhf.eval import pair_metrics
from jaxrlhf.models import scoring

MODES = ("in_step", "precomputed")


def check_reference_mode(c) -> None:
  """'precomputed' only for losses that read the reference per example."""
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  algorithm = algorithms.get(c.algorithm)
  training = algorithm.training
  supported = isinstance(training, base.Offline) and (
      training.precomputable_reference)
  config_schema.require(
      c.reference_logprobs.mode == "in_step" or supported,
      "reference_logprobs.mode",
      f"'precomputed' does not apply to {c.algorithm!r}, whose reference "
      "log-probs depend on more than each example's own completion (KTO's "
      "KL baseline scores mismatched pairs that change with the batch; "
      "online algorithms score fresh samples; reference-free losses have "
      "none); use 'in_step'.")


REFERENCE_LOGPROBS = config_schema.Group(
    "reference_logprobs",
    "Where the reference log-probs of offline losses come from (the "
    "algorithms whose loss reads them only per example: dpo, dro_v).", [
        config_schema.Field(
            "mode", "in_step",
            "'in_step' runs the frozen reference on every batch; "
            "'precomputed' scores the training split with the reference once "
            "before training (TRL's precompute_ref_log_probs), stores the "
            "results in cache_dir and feeds them to the loss with each batch, "
            "so that training neither holds nor runs the reference "
            "(evaluation loads it from init.policy_checkpoint while it "
            "runs). Not for kto: its KL baseline scores mismatched pairs that "
            "depend on the batch.", choices=MODES),
        config_schema.Field(
            "cache_dir", "",
            "Where the precomputed values live; '' = <workdir>/"
            "reference_logprobs. A resumed run reuses them; a cache made with "
            "another reference checkpoint, task, split, lengths or model is "
            "recomputed by a fresh run and is an error for a resumed one."),
        config_schema.Field(
            "batch_size", None,
            "Examples per forward pass of the precomputation; unset = the "
            "train step's micro-batch (train.batch_size / "
            "train.num_microbatches).", type=int, bounds=">0"),
    ], checks=(check_reference_mode,))


# --- networks ------------------------------------------------------------------


def starting_checkpoint(trainer) -> str:
  """config.init.policy_checkpoint, which a policy algorithm needs."""
  path = trainer.config.init.policy_checkpoint
  if not path:
    raise ValueError(
        f"config.init.policy_checkpoint: {trainer.config.algorithm} starts "
        "from a trained policy (usually the SFT run's workdir) and uses it "
        "as the reference; set the path.")
  return path


def policy(trainer, rng):
  return {"policy": trainer.init_lm(rng)}


def reference(trainer, rng):
  if trainer.precomputed_reference:
    return {}
  return {"reference": trainer.init_lm(rng)}


def policy_and_reference_checkpoints(trainer) -> Dict[str, str]:
  path = starting_checkpoint(trainer)
  if trainer.precomputed_reference:
    return {"params/policy": path}
  return {"params/policy": path, "frozen/reference": path}


def policy_checkpoint(trainer) -> Dict[str, str]:
  return {"params/policy": starting_checkpoint(trainer)}


# The policy and its frozen reference (DPO's family, KTO, DRO-V).
POLICY_AND_REFERENCE = base.Networks(
    trainable=policy, frozen=reference,
    checkpoints=policy_and_reference_checkpoints, reference=True)
# A reference-free policy loss; evaluation still compares with the starting
# policy, loaded while it runs.
POLICY_ONLY = base.Networks(trainable=policy,
                            checkpoints=policy_checkpoint, reference=True)


# --- log-probs -------------------------------------------------------------------


def sequence_logprobs(trainer, params, batch, names: Sequence[str], rng=None):
  """{name: [batch] log pi(completion | prompt)} from one forward pass."""
  scored = scoring.score_many(trainer.lm, params, batch, names, rng=rng)
  return {n: jnp.sum(lp, axis=-1) for n, (lp, _) in scored.items()}


def completion_lengths(trainer, batch, names: Sequence[str]):
  """{name: [batch] completion tokens (EOS included)}, any architecture."""
  suffix = ("decoder_loss_weights" if trainer.lm.is_encoder_decoder
            else "loss_weights")
  return {n: jnp.sum(batch[f"{n}_{suffix}"], axis=-1) for n in names}


def reference_logprobs(trainer, frozen, batch, names: Sequence[str]):
  """{name: [batch] log pi_ref(completion | prompt)}: from the frozen
  reference, or, when precomputed, from the batch's `reference_logp_*`."""
  if trainer.precomputed_reference:
    missing = [n for n in names
               if reference_cache.feature_name(n) not in batch]
    if missing:
      raise ValueError(
          f"config.reference_logprobs.mode='precomputed', but the batch has "
          f"no {[reference_cache.feature_name(n) for n in missing]}: read "
          "training batches from trainer.train_batches(), which adds them.")
    return {n: batch[reference_cache.feature_name(n)] for n in names}
  return jax.lax.stop_gradient(
      sequence_logprobs(trainer, frozen["reference"], batch, names))


# --- precomputed reference log-probs -------------------------------------------


def _completion_fields(trainer):
  return alignment_data.get_kind(trainer.algorithm.data).completion_fields


def precomputed_spec(trainer, batch_size: int):
  """{feature: jax.ShapeDtypeStruct} of the `reference_logp_*` features
  `with_precomputed_logprobs` adds to a global batch."""
  return {reference_cache.feature_name(f): jax.ShapeDtypeStruct(
      (batch_size,), np.float32) for f in _completion_fields(trainer)}


def with_precomputed_logprobs(trainer, batches):
  """Training batches with each example's `reference_logp_*` added."""
  if trainer._reference_table is None:  # pylint: disable=protected-access
    prepare_table(trainer, trainer.initial_policy_params, new_run=False)
  return reference_cache.WithReferenceLogprobs(
      batches, trainer._reference_table,  # pylint: disable=protected-access
      {f: reference_cache.scoring_features(trainer.lm, f)
       for f in _completion_fields(trainer)})


def cache_dir(trainer) -> str:
  cfg = trainer.config.reference_logprobs
  if cfg.cache_dir:
    return cfg.cache_dir
  if trainer.workdir:
    return os.path.join(trainer.workdir, "reference_logprobs")
  raise ValueError(
      "config.reference_logprobs.cache_dir: unset, and this trainer was not "
      "given a workdir to put the precomputed reference log-probs in; set "
      "it to a directory.")


def checkpoint_fingerprint(path: str) -> Dict[str, str]:
  """A checkpoint path and the step directory it resolves to (a workdir or
  T5X model directory means its latest step, which may move on)."""
  path = os.path.abspath(os.fspath(path))
  return {"path": path,
          "resolved": os.path.abspath(pretrained.resolve_checkpoint(path))}


def fingerprint(trainer) -> Dict:
  """What the precomputed values depend on; a cache with another one is not
  reused."""
  cfg = trainer.config
  path = trainer.algorithm.networks.checkpoints(trainer).get("params/policy")
  return {
      "reference": (checkpoint_fingerprint(path) if path
                    else {"random_init_seed": cfg.seed}),
      "model": cfg.model.to_dict(),
      "task": cfg.data.task,
      "split": cfg.data.train_split,
      "data_files": cfg.data.files.to_dict(),
      "feature_lengths": dict(trainer.feature_lengths),
      "feature_converter": type(trainer.feature_converter).__name__,
      "completion_fields": list(_completion_fields(trainer)),
  }


def prepare_table(trainer, reference_params, new_run: bool) -> None:
  """Loads the precomputed reference log-probs into the trainer, computing
  them first when the cache is absent, or stale in a new run (a stale cache
  of a resumed run is a CacheMismatchError)."""
  if isinstance(pipeline.get_task(trainer.config.data.task), seqio.Mixture):
    raise ValueError(
        f"config.data.task: {trainer.config.data.task!r} is a seqio mixture; "
        "precomputed reference log-probs need one pass that sees every "
        "training example, which a mixture's sampling does not promise. "
        "Train on a task, or use reference_logprobs.mode='in_step'.")
  directory = cache_dir(trainer)
  expected = fingerprint(trainer)
  try:
    table = reference_cache.load(directory, expected)
  except reference_cache.CacheMismatchError as e:
    if not new_run:
      raise
    console.log(f"{e} This is a new run, so it recomputes them.")
    table = None
  if table is not None:
    console.log(f"Using {len(table)} precomputed reference log-probs from "
                f"{directory}")
  else:
    table = _build_table(trainer, reference_params(), directory, expected)
  trainer._reference_table = table  # pylint: disable=protected-access


def _build_table(trainer, params, directory, expected):
  cfg = trainer.config
  global_size = (cfg.reference_logprobs.batch_size
                 or cfg.train.batch_size // cfg.train.num_microbatches)
  dp = sharding.data_parallel_size(trainer.mesh, trainer.rules)
  if global_size % dp or global_size % jax.process_count():
    raise ValueError(
        f"config.reference_logprobs.batch_size: {global_size} rows cannot "
        f"be split over {dp} data-parallel shards and "
        f"{jax.process_count()} processes; use a multiple of both.")
  fields = _completion_fields(trainer)
  score_fn = jax.jit(
      lambda p, b: sequence_logprobs(trainer, p, b, fields),
      in_shardings=(trainer.state_shardings.params["policy"],
                    sharding.batch_sharding(trainer.mesh, trainer.rules, 1)),
      out_shardings=sharding.replicated(trainer.mesh))

  def score(local_batch):
    return score_fn(params, sharding.global_batch(local_batch, trainer.mesh,
                                                  trainer.rules))

  batches = pipeline.BatchIterator(
      cfg.data.task, cfg.data.train_split, trainer.feature_lengths,
      trainer.feature_converter, global_size, seed=cfg.seed, shuffle=False,
      num_epochs=1, drop_remainder=False)
  # Only for progress lines; a source may not know its size.
  total = pipeline.get_task(cfg.data.task).num_input_examples(
      cfg.data.train_split)
  console.log(f"Precomputing reference log-probs of {cfg.data.task}:"
              f"{cfg.data.train_split} into {directory}")
  keys, logprobs = reference_cache.compute(
      batches, pipeline.local_batch_size(global_size), score,
      {f: reference_cache.scoring_features(trainer.lm, f) for f in fields},
      total_examples=total)
  reference_cache.write(directory, expected, keys, logprobs)
  return reference_cache.load(directory, expected)


# --- evaluation --------------------------------------------------------------------


def eval_prompts(trainer, split: str = ""):
  """(prompt tokens [n, Lp], prompt texts, judge) of the held-out prompts of
  config.eval.task's `split` (default config.eval.split), read once per run,
  or None when nothing can judge them (the gold reward judges and the task
  has none). A task with `inputs` (SFT-style) gives its first
  eval.num_examples examples' inputs; a task of an alignment kind its first
  eval.num_examples distinct prompts."""
  cfg = trainer.config
  split = split or cfg.eval.split

  def read():
    task = cfg.eval.task or cfg.data.task
    judge = judges.make_judge(trainer, task)
    if judge is None:
      return None
    if "inputs" in pipeline.get_task(task).output_features:
      features, texts = pipeline.eval_examples(
          task, split, {"inputs": cfg.data.inputs_length,
                        "targets": cfg.data.targets_length},
          seqio.EncDecFeatureConverter(pack=False), cfg.eval.num_examples)
      return (features["encoder_input_tokens"], [t["inputs"] for t in texts],
              judge)
    tokens, texts = prompts_lib.held_out_prompts(
        task, split, cfg.data.inputs_length, cfg.eval.num_examples)
    return tokens, texts, judge

  key = "eval_prompts" if split == cfg.eval.split else f"eval_prompts:{split}"
  return trainer.once(key, read)


def check_eval_task(trainer) -> None:
  """The judge must be able to work (`judges.check`); a named eval task must
  exist and, judged by the gold reward, have one; without any judge the run
  says once that it will not judge the policy."""
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
           and not split and held_out_pairs(trainer) is not None)
  if prompts is None and not pairs:
    return {}
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


def describe_against_reference(trainer) -> str:
  e = trainer.config.eval
  text = (f"{e.num_examples} held-out prompts x {e.num_samples} samples at "
          f"temperature {e.temperature:g}, against the reference's")
  if e.judge != "gold_reward":
    task = e.task or trainer.config.data.task
    text += f", {judges.make_judge(trainer, task).describe()}"
  if e.num_folds > 1:
    text += f", in {e.num_folds} folds"
  return text


AGAINST_REFERENCE = base.Evaluation(evaluate=against_reference,
                                    describe=describe_against_reference,
                                    check=check_eval_task)


# --- held-out pairs: the implicit reward (PPO details, detail 19) -------------------


def held_out_pairs(trainer):
  """This process's features of the first eval.num_examples pairs of
  config.data.task's config.data.eval_split (data.files.validation), read
  once; None when the task has no such split."""
  cfg = trainer.config

  def read():
    try:
      features, _ = pipeline.eval_examples(
          cfg.data.task, cfg.data.eval_split, trainer.feature_lengths,
          trainer.feature_converter, cfg.eval.num_examples)
    except (ValueError, KeyError, StopIteration):
      return None
    return features

  return trainer.once("held_out_pairs", read)


def _pair_logprobs(trainer, params, features) -> Dict[str, np.ndarray]:
  """{"chosen", "rejected": [n] log pi(completion | prompt)} of this
  process's held-out pairs."""
  score = trainer.once("held_out_pair_scorer", lambda: jax.jit(
      lambda p, b: sequence_logprobs(trainer, p, b, ("chosen", "rejected"))))
  n = len(next(iter(features.values())))
  parts = [jax.tree.map(evaluation.local_rows, score(params, b))
           for b in evaluation.global_batches(
               features, trainer.config.eval.batch_size, trainer.mesh,
               trainer.rules)]
  return jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *parts)


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
  features = held_out_pairs(trainer)
  if features is None:
    return {}
  # The reference never changes: its log-probs are computed once.
  ref = trainer.once("held_out_pair_reference", lambda: _pair_logprobs(
      trainer, reference_params, features))
  pi = _pair_logprobs(trainer, policy, features)
  return pair_metrics.pair_metrics(
      pi["chosen"] - ref["chosen"], pi["rejected"] - ref["rejected"],
      features, "implicit_reward",
      pair_metrics.confidence_scale(trainer.config.data.task))

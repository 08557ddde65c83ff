"""Reward modelling: Bradley-Terry on preference pairs (optional margin,
reward centring, and every prompt weighted once) and, on K-wise rankings,
Plackett-Luce or Bradley-Terry over all pairs
(jaxrlhf.losses.reward_model_losses).

The reward model is a copy of the policy backbone (`init.policy_checkpoint`)
with a scalar head read at the completion's EOS (jaxrlhf.models.heads).

With `reward_model.normalize_on_task` set, the end of training shifts the
head's bias so that the reference completions (the task's `targets`) score
mean 0 ("N+ implementation details of RLHF with PPO", detail 15); the loop
then saves that state as the final checkpoint through its usual atomic
save, so PPO and the other online algorithms that read this run get
normalised rewards. The mean before and after is logged with the last
step's metrics (`reward_normalization/...`).
"""

from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import config_schema
from jaxrlhf import console
from jaxrlhf import run_cache
from jaxrlhf import sharding
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms.offline import training
from jaxrlhf.data import file_layouts
from jaxrlhf.eval import evaluation
from jaxrlhf.eval import pair_metrics
from jaxrlhf.losses import reward_model_losses
from jaxrlhf.models import heads
from jaxrlhf.models import scoring

F = config_schema.Field

RANKING_LOSSES = ("plackett_luce", "all_pairs")

GROUP = config_schema.Group(
    "reward_model",
    "The reward models (reward_model on pairs, reward_model_ranking on "
    "K-wise rankings).", [
        F("use_margin", False,
          "Use the pairs' 'margin' feature in the Bradley-Terry loss (Llama "
          "2). The training loss then includes it; eval/loss is the plain "
          "Bradley-Terry loss, so the two are not comparable."),
        F("centering_coef", 0.0,
          "Weight of the reward-centring term (r_chosen + r_rejected)^2.",
          bounds=">=0"),
        F("num_completions", 4,
          "reward_model_ranking: K, the completions per ranking (best "
          "first).", bounds=">=2"),
        F("weight_prompts_equally", True,
          "Weigh each pair by its 'prompt_weight' feature (file sources set "
          "it so every prompt counts once however many pairs it has; "
          "InstructGPT, RLHF book eq. 6). Data with one pair per prompt, or "
          "the same number for every prompt, train exactly as unweighted."),
        F("ranking_loss", "plackett_luce",
          "reward_model_ranking's loss: 'plackett_luce' (the K-wise "
          "likelihood) or 'all_pairs' (Bradley-Terry on all C(K, 2) pairs of "
          "a ranking, each weighted 1 / C(K, 2): InstructGPT's scheme).",
          choices=RANKING_LOSSES),
        F("normalize_on_task", "",
          "Reward normalisation (PPO details, detail 15; Stiennon et al. "
          "2020): at the end of training, shift the head's bias so the "
          "reference completions (the `targets`) of this seqio task's "
          "prompts score mean 0; the final checkpoint holds the shifted "
          "head, so runs reading this reward model get normalised scores. "
          "'' = off. E.g. the SFT task, 'synthetic_summarize'."),
        F("normalize_files", "",
          "Files of SFT demonstrations (layout normalize_layout) registered "
          "as the task normalize_on_task at start-up, for normalising on "
          "data read from files (the TL;DR SFT data, detail 15); '' = "
          "normalize_on_task is a registered task.", path=True),
        F("normalize_layout", "tldr_sft",
          "The layout of normalize_files ('tldr_sft', or 'columns' with "
          "prompt and completion columns).",
          choices=file_layouts.DEMONSTRATION_LAYOUTS),
        F("normalize_split", "train",
          "The split of normalize_on_task to score."),
        F("normalize_num_examples", 0,
          "How many of its first examples to score (0 = all of them).",
          bounds=">=0"),
    ])


# --- networks ----------------------------------------------------------------------


def reward_network(trainer, rng):
  a, b = jax.random.split(rng)
  return {"reward": heads.init_from_backbone(a, trainer.init_lm(b),
                                             trainer.model_config.emb_dim)}


def checkpoints(trainer):
  return {"params/reward/backbone": trainer.config.init.policy_checkpoint}


NETWORKS = base.Networks(trainable=reward_network, checkpoints=checkpoints)


# --- pairs ---------------------------------------------------------------------------


def pair_rewards(lm, reward_params, batch):
  """(chosen rewards [batch], rejected rewards [batch]), one forward pass."""
  joined = scoring.concatenate_completions(lm, batch, ("chosen", "rejected"))
  rewards = heads.sequence_rewards(lm, reward_params, joined, "joined")
  return jnp.split(rewards, 2)


def pairs_loss(trainer, params, state, batch, rng):
  del state, rng
  cfg = trainer.config.reward_model
  chosen, rejected = pair_rewards(trainer.lm, params["reward"], batch)
  margin = batch["margin"] if cfg.use_margin and "margin" in batch else None
  # The file sources' per-pair prompt weights average 1 over the data, so
  # the weighted batch mean estimates the mean over prompts of each
  # prompt's mean pair loss (InstructGPT; RLHF book eq. 6).
  weights = (batch.get("prompt_weight") if cfg.weight_prompts_equally
             else None)
  return reward_model_losses.bradley_terry_loss(
      chosen, rejected, margin=margin, weights=weights,
      centering_coef=cfg.centering_coef)


@run_cache.per_run
def _reward_scorer(trainer, reward_fn):
  """`reward_fn` (lm, reward params, batch) compiled once."""
  return jax.jit(lambda p, b: reward_fn(trainer.lm, p, b))


def eval_rewards(trainer, state, reward_fn):
  """reward_fn(lm, reward params, batch) over the eval split's first
  `eval.num_examples` examples: (this process's rewards as numpy arrays
  [n, ...], their features), or None when the task has no such split."""
  cfg = trainer.config
  features = policy_eval.eval_split_features(trainer)
  jitted = _reward_scorer(trainer, reward_fn)
  if features is None:
    return None
  n = len(next(iter(features.values())))
  outputs = [jax.tree.map(evaluation.local_rows,
                          jitted(state.params["reward"], b))
             for b in evaluation.global_batches(
                 features, cfg.eval.batch_size, trainer.mesh, trainer.rules)]
  rewards = jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *outputs)
  return rewards, features


def evaluate_pairs(trainer, state) -> Dict[str, float]:
  """Accuracy, loss and calibration on the eval split's pairs, and the
  accuracy by annotation batch and by annotator confidence (PPO details,
  detail 16; `jaxrlhf.eval.pair_metrics`)."""
  evaluated = eval_rewards(trainer, state, pair_rewards)
  if evaluated is None:
    return {}
  (chosen_np, rejected_np), features = evaluated
  chosen, rejected = jnp.asarray(chosen_np), jnp.asarray(rejected_np)
  _, m = reward_model_losses.bradley_terry_loss(chosen, rejected)
  table = reward_model_losses.calibration_table(chosen, rejected, num_bins=5)
  metrics = {"eval/accuracy": float(m["accuracy"]),
             "eval/loss": float(m["bt_loss"]),
             "eval/margin": float(m["margin"]),
             "eval/expected_calibration_error":
                 float(table["expected_calibration_error"])}
  metrics.update(pair_metrics.grouped_accuracy(
      pair_metrics.wins(chosen_np, rejected_np), features, "eval/accuracy",
      pair_metrics.confidence_scale(trainer.config.data.task)))
  return metrics


def describe(config) -> str:
  return (f"the first {config.eval.num_examples} examples of split "
          f"{config.data.eval_split!r}")


# --- reward normalisation (PPO details, detail 15) -----------------------------------


def register_normalization_files(trainer) -> None:
  """Registers reward_model.normalize_files as the task normalize_on_task."""
  # The data stack loads here, where the data is read, not with the config.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import file_tasks  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  rm = cfg.reward_model
  field = "config.reward_model.normalize_on_task"
  if not rm.normalize_on_task:
    raise ValueError(f"{field}: reward_model.normalize_files is set; name the "
                     "task its demonstrations are registered as (e.g. "
                     "'tldr_sft_demonstrations').")
  file_tasks.check_task_name(rm.normalize_on_task, field,
                             "config.reward_model.normalize_files")
  if not tf.io.gfile.glob(rm.normalize_files):
    raise ValueError(f"config.reward_model.normalize_files: no file matches "
                     f"{rm.normalize_files!r}.")
  file_tasks.register_demonstrations_task(
      rm.normalize_on_task, {rm.normalize_split: rm.normalize_files},
      vocabulary=trainer.vocabulary, layout=rm.normalize_layout,
      max_prompt_tokens=trainer.prompt_length,
      max_completion_tokens=cfg.data.targets_length,
      on_bad_row=cfg.data.files.on_bad_row, seed=cfg.seed)


def check_normalize_task(trainer) -> None:
  """Fails at start-up, naming the field, if the task cannot be scored."""
  # The data stack loads here, where the data is read, not with the config.
  import seqio  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import vocab  # pylint: disable=g-import-not-at-top
  rm = trainer.config.reward_model
  if rm.normalize_files:
    register_normalization_files(trainer)
  name = rm.normalize_on_task
  if not name:
    return
  field = "config.reward_model.normalize_on_task"
  if name not in seqio.TaskRegistry.names() and (
      name not in seqio.MixtureRegistry.names()):
    raise ValueError(
        f"{field}: no seqio task or mixture named {name!r} is registered. "
        "Use the SFT task whose targets are the reference completions "
        "(e.g. 'synthetic_summarize'), register it first or list its "
        "module in config.data.task_modules, or set it to '' to skip "
        "reward normalisation.")
  features = seqio.get_mixture_or_task(name).output_features
  missing = [k for k in ("inputs", "targets") if k not in features]
  if missing:
    raise ValueError(
        f"{field}: task {name!r} has no {missing} feature(s) (it has "
        f"{sorted(features)}); reward normalisation scores each prompt "
        "('inputs') with its reference completion ('targets'), as an SFT "
        "task holds them.")
  vocabulary = features["targets"].vocabulary
  vocab.require_same(trainer.vocabulary, vocabulary,
                     f"{field}: the reward model", f"task {name!r}",
                     "Use a task with the reward model's vocabulary.")


@run_cache.per_run
def reference_features(trainer) -> Dict[str, np.ndarray]:
  """This process's share of the normalisation task's (prompt, reference
  completion) pairs, as features of one completion named "completion"
  ([n, ...] numpy arrays, the task's order); read once."""
  # The data stack loads here, where the data is read, not with the config.
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import alignment_data  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  cfg = trainer.config
  rm = cfg.reward_model
  task = seqio.get_mixture_or_task(rm.normalize_on_task)
  shard = seqio.ShardInfo(index=jax.process_index(),
                          num_shards=jax.process_count())
  try:
    ds = task.get_dataset({"inputs": trainer.prompt_length,
                           "targets": cfg.data.targets_length},
                          split=rm.normalize_split, shuffle=False,
                          shard_info=shard, num_epochs=1)
  except (ValueError, KeyError) as e:
    raise ValueError(
        f"config.reward_model.normalize_split: cannot read split "
        f"{rm.normalize_split!r} of task {rm.normalize_on_task!r} ({e}).")
  # A reference completion is a trajectory's completion; its converter
  # lays it out like the pairs' completions for either architecture.
  ds = ds.map(lambda ex: {"prompt": ex["inputs"],
                          "completion": ex["targets"],
                          "reward": tf.constant(0.0, tf.float32)})
  converter = alignment_data.feature_converter_for(
      "trajectory", trainer.architecture, **trainer.converter_options())
  ds = converter(ds, {"prompt": trainer.prompt_length,
                      "completion": cfg.data.targets_length})
  if rm.normalize_num_examples:
    ds = ds.take(pipeline.local_batch_size(rm.normalize_num_examples))
  rows = list(ds.as_numpy_iterator())
  if not rows:
    raise ValueError(
        f"config.reward_model.normalize_on_task: split "
        f"{rm.normalize_split!r} of task {rm.normalize_on_task!r} gave no "
        "example to normalise the rewards with.")
  keys = [k for k in rows[0] if k != "reward"]
  return {k: np.stack([r[k] for r in rows]) for k in keys}


@run_cache.per_run
def _completion_scorer(trainer):
  """The compiled reward of each example's "completion"."""
  return jax.jit(
      lambda p, b: heads.sequence_rewards(trainer.lm, p, b, "completion"))


def reference_rewards(trainer, reward_params) -> np.ndarray:
  """[n] rewards of this process's reference completions."""
  features = reference_features(trainer)
  score = _completion_scorer(trainer)
  n = len(next(iter(features.values())))
  rewards = [evaluation.local_rows(score(reward_params, b))
             for b in evaluation.global_batches(
                 features, trainer.config.eval.batch_size, trainer.mesh,
                 trainer.rules)]
  return np.concatenate(rewards)[:n]


def mean_reference_reward(trainer, reward_params) -> Tuple[float, int]:
  """(mean reward of the reference completions over all processes, their
  number)."""
  rewards = reference_rewards(trainer, reward_params).astype(np.float64)
  if not np.all(np.isfinite(rewards)):
    raise FloatingPointError(
        "reward normalisation: the reward model gives non-finite rewards "
        f"to {int(np.sum(~np.isfinite(rewards)))} reference completions.")
  total, count = float(rewards.sum()), float(rewards.size)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    sums = np.asarray(multihost_utils.process_allgather(
        np.array([total, count], np.float64))).reshape(-1, 2).sum(0)
    total, count = float(sums[0]), float(sums[1])
  return total / count, int(count)


@run_cache.per_run
def _bias_shifter(trainer):
  """(state, shift) -> the state with its reward head's bias moved by
  shift, compiled once (the state donated)."""
  return jax.jit(
      lambda s, shift: s.replace(params=dict(
          s.params, reward=heads.shift_bias(s.params["reward"], shift))),
      in_shardings=(trainer.state_shardings,
                    sharding.replicated(trainer.mesh)),
      out_shardings=trainer.state_shardings, donate_argnums=0)


def normalize_reward_bias(trainer, state):
  """(state whose reward head's bias makes the reference completions score
  mean 0, {"reward_normalization/...": before/after means, shift, count}).

  Only the bias moves, so every reward moves by the same amount and reward
  differences (and pair accuracy) are unchanged.
  """
  rm = trainer.config.reward_model
  # (A LoRA run's reward model is its base with adapters: `Trainer.view`.)
  before, count = mean_reference_reward(
      trainer, trainer.view(state).params["reward"])
  state = _bias_shifter(trainer)(state, np.float32(-before))
  after, _ = mean_reference_reward(trainer,
                                   trainer.view(state).params["reward"])
  console.log(
      f"Reward normalisation: mean reward of {count} reference completions "
      f"({rm.normalize_on_task!r}, split {rm.normalize_split!r}) "
      f"{console.fixed(before, 6)} -> {console.fixed(after, 6)} (head bias "
      f"shifted by {console.fixed(-before, 6)}).")
  return state, {"reward_normalization/mean_before": before,
                 "reward_normalization/mean_after": after,
                 "reward_normalization/bias_shift": -before,
                 "reward_normalization/num_examples": float(count)}


def finish(trainer, state):
  """The final checkpoint holds the normalised head (the loop saves after
  this, atomically)."""
  if not trainer.config.reward_model.normalize_on_task:
    return state, {}
  return normalize_reward_bias(trainer, state)


ALGORITHM = base.Algorithm(
    name="reward_model",
    summary="Bradley-Terry reward model on preference pairs (optional margin "
    "and centring; every prompt weighed once; optional bias normalisation, "
    "PPO detail 15).",
    data="pairs",
    networks=NETWORKS,
    training=training.Offline(loss=pairs_loss),
    evaluation=base.Evaluation(evaluate=evaluate_pairs, describe=describe,
                               check=check_normalize_task),
    config_groups=(GROUP,),
    finish=finish,
)


# --- rankings ------------------------------------------------------------------------


def ranking_feature_lengths(trainer):
  # seqio trims a ranking's first axis to the "completions" length, so it
  # must be at least K (the converter checks).
  c = trainer.config
  return {"prompt": trainer.prompt_length,
          "completions": max(c.data.targets_length,
                             c.reward_model.num_completions)}


def ranking_feature_converter(trainer):
  # The data stack loads here, where the data is read, not with the config.
  from jaxrlhf.data import alignment_data  # pylint: disable=g-import-not-at-top
  return alignment_data.feature_converter_for(
      "ranking", trainer.architecture,
      num_completions=trainer.config.reward_model.num_completions,
      **trainer.converter_options())


def ranked_rewards(lm, reward_params, batch):
  """[batch, K] rewards of each example's K completions (one pass over the
  batch's K * batch (prompt, completion) rows)."""
  b, k = batch["completions_mask"].shape
  flat = {key: jnp.repeat(batch[key], k, axis=0)
          for key in lm.prompt_keys if key in batch}
  for key in lm.completion_keys("completions"):
    flat[key] = batch[key].reshape((b * k,) + batch[key].shape[2:])
  rewards = heads.sequence_rewards(lm, reward_params, flat, "completions")
  return rewards.reshape(b, k)


def ranking_loss(config, rewards, mask):
  if config.reward_model.ranking_loss == "all_pairs":
    return reward_model_losses.all_pairs_ranking_loss(rewards, mask)
  return reward_model_losses.plackett_luce_loss(rewards, mask)


def rankings_loss(trainer, params, state, batch, rng):
  del state, rng
  rewards = ranked_rewards(trainer.lm, params["reward"], batch)
  return ranking_loss(trainer.config, rewards, batch["completions_mask"])


def evaluate_rankings(trainer, state) -> Dict[str, float]:
  """The ranking loss, top-1 and pairwise accuracy on the eval split."""
  evaluated = eval_rewards(trainer, state, ranked_rewards)
  if evaluated is None:
    return {}
  rewards, features = evaluated
  _, m = ranking_loss(trainer.config, jnp.asarray(rewards),
                      jnp.asarray(features["completions_mask"]))
  return {f"eval/{name}": float(m[name])
          for name in ("loss", "top1_accuracy", "pairwise_accuracy")}


RANKING = base.Algorithm(
    name="reward_model_ranking",
    summary="Reward model on K-wise rankings: Plackett-Luce, or "
    "Bradley-Terry on all K-choose-2 pairs (InstructGPT).",
    data="ranking",
    networks=NETWORKS,
    training=training.Offline(loss=rankings_loss),
    evaluation=base.Evaluation(evaluate=evaluate_rankings, describe=describe,
                               check=check_normalize_task),
    config_groups=(GROUP,),
    finish=finish,
    feature_lengths=ranking_feature_lengths,
    feature_converter=ranking_feature_converter,
)

ALGORITHMS = (ALGORITHM, RANKING)

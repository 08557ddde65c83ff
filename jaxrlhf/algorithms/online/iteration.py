"""The online RL step, top to bottom, and its named parts.

`online_step` is the step: prompts -> sample -> score -> rewards ->
advantages -> updates. Its parts (`StepParts`) are functions of arrays,
built once from the trainer before the first step (`step_parts`). A driver
decides where and when each part runs, never what it computes:

  fused       the whole step in one `jax.jit` (`fused_step`): every reward
              is computed on the device
  host split  sample and score compiled, the host's rewards (and DAPO's
              dynamic sampling) between them and the update (`host_split`)
  overlap     the rollout made on sampler devices of their own, one step
              ahead of the update (`overlap`)

The random keys are the same under every driver, so a run whose host
rewards add 0 trains as the fused step does (tests/test_online_rewards.py),
and sampler devices without off-policy steps train as the fused step does
(tests/test_eight_devices.py).
"""

import dataclasses
import functools
from typing import Any, Callable, Iterable, List, Tuple

import jax
import jax.numpy as jnp

from jaxrlhf import sharding
from jaxrlhf.algorithms import update as update_lib
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import teacher
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.rl import importance_sampling
from jaxrlhf.rl import reductions
from jaxrlhf.rl import rollout as rollout_lib


@dataclasses.dataclass(frozen=True)
class StepParts:
  """The named parts of an online step (`online_step` calls them in order).

  Attributes:
    rounds: (batch, rollouts so far) -> the prompt batches to sample: the
      step's own, then more only while dynamic sampling wants groups that
      vary.
    sample: (params, frozen, prompts {features: [P, ...]}, key) ->
      `sampling.Samples` [P * k, L]: k responses per prompt, adjacent, of
      the prompts' tokens (multi-turn episodes: `episode_step`, which
      reads the prompts' rows).
    score: (params, frozen, prompt_tokens, samples, references) ->
      `rollout_lib.Rollout`: truncated after the EOS, the policy's and
      reference's log-probs at the sampling temperature, the rewards
      computed on the device; references: the prompts' own completions
      [P, L] (`prompts_lib.COMPLETIONS`) when the batch carries them, for
      a pairwise judge, else None.
    host_rewards: (rollout, samples, batch) -> (rollout with the host's
      rewards, {reward/<name>/skipped: count}).
    keep: ([(rollout, metrics)] of the rounds) -> (the rollout to train on,
      metrics).
    correct: (state, rollout) -> (rollout, [rows, L] weights of each
      token's advantage or None, metrics): what the update does about the
      gap between the policy that sampled and the one it trains.
    advantages: (state, rollout, token_weights) -> (the rows the updates
      train on {name: [rows, ...]}, the algorithm state carried to the next
      step, metrics): the algorithm's targets.
    update: (state, rows, algorithm_state, update_key, next_key) -> (next
      state, metrics): num_epochs x num_minibatches gradient updates.
  """
  rounds: Callable[[Any, List[Any]], Iterable[Any]]
  sample: Callable[..., Any]
  score: Callable[..., Any]
  host_rewards: Callable[..., Tuple[Any, dict]]
  keep: Callable[[List[Any]], Tuple[Any, dict]]
  correct: Callable[..., Tuple[Any, Any, dict]]
  advantages: Callable[..., Tuple[Any, Any, dict]]
  update: Callable[..., Tuple[Any, dict]]


def online_step(parts: StepParts, state, batch):
  """One online RL step: (state, {prompt features: [P, ...]}) -> (next
  state, metrics)."""
  next_key, rollout_key, update_key = split_step_key(state.rng)
  # Prompts -> sample -> score -> rewards, in rounds: one, unless dynamic
  # sampling asks for more prompts to find groups whose rewards vary.
  rounds = sample_rounds(parts, state.params, state.frozen, batch,
                         rollout_key)
  rollout, metrics = parts.keep(rounds)
  # Off-policy: the gap between the policy that sampled and this one.
  rollout, token_weights, gap_metrics = parts.correct(state, rollout)
  # Advantages: the algorithm's targets (and what it carries on).
  rows, algorithm_state, target_metrics = parts.advantages(
      state, rollout, token_weights)
  # Updates: num_epochs passes of num_minibatches gradient steps.
  state, update_metrics = parts.update(state, rows, algorithm_state,
                                       update_key, next_key)
  return state, {**metrics, **gap_metrics, **target_metrics,
                 **update_metrics}


def sample_rounds(parts: StepParts, params, frozen, batch, rollout_key):
  """[(rollout, host metrics)] of each round of prompts `parts.rounds`
  gives (round r > 0 sampled with fold_in(rollout_key, r)): the sampling
  half of a step, which the overlap also runs ahead."""
  rounds = []
  for round_, prompts in enumerate(parts.rounds(batch, rounds)):
    key = rollout_key if not round_ else jax.random.fold_in(rollout_key,
                                                             round_)
    samples = parts.sample(params, frozen, prompts, key)
    rollout = parts.score(params, frozen, prompts[prompts_lib.PROMPT_FEATURE],
                          samples, prompts.get(prompts_lib.COMPLETIONS))
    rounds.append(parts.host_rewards(rollout, samples, prompts))
  return rounds


def split_step_key(key):
  """(next state key, rollout key, update key) of the step whose key is
  `key`."""
  return tuple(jax.random.split(key, 3))


# --- the parts, as functions of arrays ----------------------------------------


def step_parts(trainer) -> StepParts:
  """The step's parts for `trainer`, computing every reward on the device
  (the host split and the overlap replace what they run elsewhere)."""
  def policy_samples(params, frozen, prompts, key):
    return sample(trainer, params, frozen,
                  prompts[prompts_lib.PROMPT_FEATURE], key)

  around = trainer.algorithm.training.sample  # GKD mixes in the data's
  return StepParts(
      rounds=lambda batch, rounds: [batch],
      sample=policy_samples if around is None else functools.partial(
          around, trainer, policy_samples),
      score=functools.partial(score, trainer),
      host_rewards=lambda rollout, samples, batch: (rollout, {}),
      keep=lambda rounds: rounds[0],
      correct=functools.partial(correct, trainer.config),
      advantages=functools.partial(advantages, trainer),
      update=functools.partial(update, trainer))


def fused_step(trainer):
  """(state, batch) -> (state, metrics): `online_step` compiled whole, the
  batch split over the data shards and the state donated."""
  return jax.jit(
      functools.partial(online_step, step_parts(trainer)),
      in_shardings=(trainer.state_shardings,
                    sharding.batch_sharding(trainer.mesh, trainer.rules, 1)),
      out_shardings=(trainer.state_shardings,
                     sharding.replicated(trainer.mesh)),
      donate_argnums=0)


def _by_parts(parts: int, k: int, fn, prompt_tokens, responses=None,
              key=None):
  """`fn(prompts, responses, key)` over `online.rollout_microbatches` = P
  parts of the prompts, one after another (`jax.lax.map`), with the rows
  put back in prompt order.

  Part p takes prompts p, p + P, ... (`split_microbatches`), so each data
  shard's prompts feed every part and none move, with their k response rows
  of `responses` ([prompts * k, ...] leaves, adjacent per prompt) and the p-th of
  P keys split from `key`. `fn` returns response rows ([rows, ...] leaves)
  and scalars, which are added over the parts (the decode steps run); k
  is the responses per prompt."""
  if parts == 1:
    return fn(prompt_tokens, responses, key)

  def split_responses(x):
    # [prompts * k, ...] -> [P, prompts / P * k, ...], prompt-wise.
    grouped = update_lib.split_microbatches(
        x.reshape((-1, k) + x.shape[1:]), parts)
    return grouped.reshape((parts, -1) + x.shape[1:])

  xs = (update_lib.split_microbatches(prompt_tokens, parts),
        jax.tree.map(split_responses, responses),
        None if key is None else jax.random.split(key, parts))
  per_part = jax.lax.map(lambda a: fn(*a), xs)

  def merge(x):
    if x.ndim == 1:  # a scalar of each part
      return jnp.sum(x)
    # [P, prompts / P * k, ...] -> [prompts * k, ...]: prompt j * P + p's
    # k responses stay adjacent (group algorithms compare them).
    x = x.reshape((parts, x.shape[1] // k, k) + x.shape[2:])
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((-1,) + x.shape[3:])
  return jax.tree.map(merge, per_part)


def sample(trainer, params, frozen, prompt_tokens, key):
  """`samples_per_prompt` responses per prompt (adjacent rows), each prompt
  prefilled once for them: `sampling.Samples` [prompts * k, L]."""
  o, settings = trainer.config.online, trainer.online
  training = trainer.algorithm.training
  params, frozen = trainer.view_parts(params, frozen)  # LoRA: base + adapters
  sample_params = (training.sample_params(trainer.config, params, frozen)
                   if training.sample_params else params["policy"])
  engine, page_size = options.decoding(trainer.config)

  def part(prompts, unused_responses, part_key):
    return rollout_lib.sample_responses(
        trainer.lm, sample_params, prompts, part_key,
        max_new_tokens=settings.max_new_tokens, temperature=o.temperature,
        eos_id=trainer.vocabulary.eos_id,
        num_samples=settings.samples_per_prompt,
        stop_when_done=o.stop_when_done, cache_segments=o.cache_segments,
        record_routes=settings.router_replay, engine=engine,
        engine_slots=o.engine_slots, engine_page_size=page_size,
        engine_pages=o.engine_pages)
  return _by_parts(o.rollout_microbatches, settings.samples_per_prompt, part,
                   prompt_tokens, key=key)


def score(trainer, params, frozen, prompt_tokens, samples, references=None):
  """The rollout of sampled responses: truncated after their EOS, scored by
  the rewards computed on the device (the host's NaN until
  `RewardSources.with_host_rewards` fills them), with policy and reference
  log-probs at the sampling temperature (the reference's only when a KL
  term weighs them: `kl_control.scores_reference`); `references` [P, L]:
  the prompts' own completions, which a pairwise judge reads."""
  o, k = trainer.config.online, trainer.online.samples_per_prompt
  params, frozen = trainer.view_parts(params, frozen)  # LoRA: base + adapters

  def part(prompts_and_references, tokens_and_routes, unused_key):
    prompts, part_references = jax.tree.map(
        lambda x: jnp.repeat(x, k, axis=0), prompts_and_references)
    tokens, routes = tokens_and_routes
    return score_rows(trainer, params, frozen, prompts, tokens,
                      part_references, routes=routes)

  rollout = _by_parts(o.rollout_microbatches, k, part,
                      (prompt_tokens, references),
                      (samples.tokens, samples.routes))
  return with_sampler_stats(rollout, samples.num_steps, samples.logprobs,
                            samples.preemptions)


def score_rows(trainer, params, frozen, prompts, tokens, references=None, *,
               routes=None, episodes=None):
  """`score`'s rollout of rows, one per response: `prompts` [rows, Lp]
  (repeated for each prompt's responses), `tokens` [rows, L], with the
  viewed parameters (`trainer.view_parts`); `references` [rows, L] for a
  pairwise judge, `routes` the sampler's to replay, `episodes`
  multi-turn episodes' layout (`rollout_lib.assemble_rollout`, whose
  `prompts` are then the episodes' left-padded openings)."""
  o, rewards = trainer.config.online, trainer.online.rewards
  scores_reference = kl_control.scores_reference(trainer.algorithm,
                                                 trainer.config)
  rollout = rollout_lib.assemble_rollout(
      trainer.lm, params["policy"],
      frozen["reference"] if scores_reference else None,
      rewards.lm if rewards.reward_model else None,
      frozen.get("reward"), prompts, tokens,
      temperature=o.temperature, eos_id=trainer.vocabulary.eos_id,
      missing_eos_penalty=rewards.eos_trick, routes=routes,
      episodes=episodes)
  if routes is not None and o.router_replay_gap:
    # The scoring without replay, for the gap replay closes.
    unreplayed, _, _ = rollout_lib.logprobs_and_entropy(
        trainer.lm, params["policy"], rollout.features, None,
        o.temperature, rollout.mask.shape[1])
    rollout = rollout.replace(unreplayed_logprobs=unreplayed)
  # (A teacher and a judge are refused for episodes: options.check_sampling,
  # reward_sources.check_rewards.)
  if trainer.online.teacher is not None:
    rollout = teacher.score_with_teacher(trainer, frozen[teacher.TEACHER],
                                         prompts, rollout)
  judged = None
  if rewards.judge is not None:
    judged = rewards.judge.scores(
        frozen[reward_sources.JUDGE], prompts,
        rollout_lib.response_tokens(trainer.lm, rollout.features,
                                    rollout.mask.shape[1]),
        rollout.mask, trainer.vocabulary.eos_id, references)
  return rewards.with_device_rewards(rollout, judged)


def with_sampler_stats(rollout, decode_steps, sample_logprobs,
                       preemptions=None):
  """The scored rollout with what the sampler knew: its decode steps
  (int32 []), its own log-probs of the tokens it drew ([rows, L], kept
  where the rollout's mask is 1) and the engine's preemptions (int32 [] or
  None)."""
  return rollout.replace(decode_steps=decode_steps,
                         sample_logprobs=sample_logprobs * rollout.mask,
                         preemptions=preemptions)


def correct(config, state, rollout):
  """(rollout, token weights or None, metrics): the gap between the
  sampler's log-probs of the rollout's tokens and the trainer's scoring of
  them, logged every step, and `online.importance_correction` of it (none
  by default: the on-policy step as it is)."""
  del state
  return importance_correction(config, rollout.logprobs,
                               rollout.sample_logprobs, rollout)


def importance_correction(config, trainer_logprobs, sampler_logprobs,
                          rollout):
  """`online.importance_correction` of the gap between `sampler_logprobs`
  (the policy that sampled) and `trainer_logprobs` (the one the update
  starts from), both [rows, L]: (the rollout with the tokens the
  correction drops out of its mask, [rows, L] advantage weights or None
  for none, metrics with the gap's)."""
  o = config.online
  name = options.importance_correction(config)
  metrics = importance_sampling.gap_metrics(trainer_logprobs,
                                            sampler_logprobs, rollout.mask)
  if rollout.unreplayed_logprobs is not None:
    # Router replay's diagnostic: the gap had the trainer routed itself.
    metrics.update(importance_sampling.gap_metrics(
        rollout.unreplayed_logprobs, sampler_logprobs, rollout.mask,
        prefix=UNREPLAYED_GAP))
  if name == "none":
    return rollout, None, metrics
  weights, mask, correction_metrics = importance_sampling.correct(
      name, trainer_logprobs, sampler_logprobs, rollout.mask,
      cap=o.importance_weight_cap, low=o.importance_ratio_low,
      high=o.importance_ratio_high)
  metrics.update(correction_metrics)
  return rollout.replace(mask=mask), weights, metrics


# The prefix of the gap metrics without router replay
# (`online.router_replay_gap`).
UNREPLAYED_GAP = "gap/unreplayed"


def advantages(trainer, state, rollout, token_weights=None):
  """The algorithm's targets (`Online.targets`) of a scored rollout, with
  the rollout's metrics.

  Args:
    token_weights: optional [rows, L] weights of each token's advantage
      (an off-policy correction: `overlap`).

  Returns:
    (rows {name: [rows, ...]}, algorithm state, metrics).
  """
  # LoRA: the targets read the base with the adapters.
  rows, algorithm_state, target_metrics = trainer.algorithm.training.targets(
      trainer, trainer.view(state), rollout)
  # Distillation: the teacher's per-token advantage, before any weights.
  rows, target_metrics = teacher.with_distill_targets(
      trainer.config, trainer.online.teacher, rollout, rows, target_metrics)
  if token_weights is not None:
    advantage = rows["advantages"]
    if advantage.ndim == 1:
      advantage = advantage[:, None]
    rows = dict(rows, advantages=advantage * token_weights)
  metrics = rollout_lib.rollout_metrics(
      rollout, kl_control.coefficient(state),
      trainer.config.online.kl_estimator,
      reference_scored=kl_control.scores_reference(trainer.algorithm,
                                                   trainer.config))
  if trainer.online.rewards.reward_model is None:
    metrics.pop("raw_score")  # there is no reward model
  if rollout.rewards is not None:  # None: the reward model's score alone
    metrics.update(trainer.online.rewards.metrics(rollout.rewards))
  metrics.update(target_metrics)
  return rows, algorithm_state, metrics


def update(trainer, state, rows, algorithm_state, update_key, next_key):
  """The gradient updates on the targets' rows: the next train state and
  metrics."""
  training = trainer.algorithm.training
  # The updates train the adapters alone (`state.params`) through the view.
  def loss(params, minibatch):
    return training.loss(trainer,
                         trainer.view_parts(params, state.frozen)[0],
                         minibatch, state.algorithm_state)

  params, opt_state, metrics = run_updates(
      trainer, state, rows,
      teacher.with_distill_loss(trainer, loss, state.frozen), update_key)
  metrics["learning_rate"] = trainer.learning_rate(state.step)
  return state.replace(step=state.step + 1, params=params,
                       opt_state=opt_state, algorithm_state=algorithm_state,
                       rng=next_key), metrics


def run_updates(trainer, state, data, loss_fn, rng):
  """`num_epochs` passes of `num_minibatches` gradient updates over `data`.

  Args:
    state: the train state (its params and opt_state are the start).
    data: {name: [rows, ...]} arrays the loss reads; every pass reshuffles
      the rows.
    loss_fn: (params, minibatch) -> (scalar loss, {metric: scalar}).
    rng: shuffling key.

  Returns:
    (params, opt_state, metrics): metrics are means over the updates, with
    "nonfinite" the count of skipped (non-finite) updates. With
    micro-batches, metrics that are not means over what the loss counts
    (explained variance) become weighted means of the micro-batches'.
  """
  settings = trainer.online
  training = trainer.algorithm.training
  count = (functools.partial(training.loss_count, trainer.config)
           if training.loss_count else reductions.response_token_count)
  rows = jax.tree.leaves(data)[0].shape[0]
  indices = rollout_lib.minibatch_indices(rng, rows, settings.num_epochs,
                                          settings.num_minibatches)
  micro = trainer.config.train.num_microbatches

  def loss_with_rng(params, minibatch, unused_rng):
    # Nothing is random in an update's loss; the key fills the signature.
    return loss_fn(params, minibatch)

  def one_update(carry, minibatch_rows):
    params, opt_state = carry
    minibatch = jax.tree.map(lambda x: jnp.take(x, minibatch_rows, axis=0),
                             data)
    share = update_lib.weighted_share(loss_with_rng, count, minibatch, micro)
    params, opt_state, out = update_lib.gradient_update(
        trainer.tx, params, opt_state, minibatch, jax.random.PRNGKey(0),
        share, micro, trainer.accumulator_shardings)
    return (params, opt_state), out

  (params, opt_state), per_update = jax.lax.scan(
      one_update, (state.params, state.opt_state), indices)
  metrics = {k: (jnp.sum(v) if k == "nonfinite" else jnp.mean(v))
             for k, v in per_update.items()}
  return params, opt_state, metrics


def rollout_for_step(trainer, state, batch):
  """The rollout `online_step(state, batch)` trains on, with the rewards
  computed on the device (for tests and benchmarks that look inside)."""
  _, rollout_key, _ = split_step_key(state.rng)
  tokens = batch[prompts_lib.PROMPT_FEATURE]
  samples = sample(trainer, state.params, state.frozen, tokens, rollout_key)
  return score(trainer, state.params, state.frozen, tokens, samples)


def make_rollout(trainer, params, frozen, prompt_tokens, key):
  """`sample` then `score`: a rollout of `prompt_tokens` [P, Lp]."""
  samples = sample(trainer, params, frozen, prompt_tokens, key)
  return score(trainer, params, frozen, prompt_tokens, samples)

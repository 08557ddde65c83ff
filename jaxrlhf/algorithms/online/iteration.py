"""The iteration of online RL, as functions of the trainer and arrays.

  sample      samples_per_prompt responses per prompt from the policy (or
              the reference), each prompt prefilled once for them
  assemble    truncated after their EOS, scored by the rewards computed in
              the step (the reward model at the EOS, the EOS trick, the
              overlong penalty), with policy and reference log-probs at the
              sampling temperature
  (host)      the host's rewards added, when there are any
              (`with_host_rewards`; `online_host.HostSplitStep`)
  update      the algorithm's targets (`Online.targets`), then num_epochs
              passes of num_minibatches gradient updates over their rows
              (`run_updates`), all inside one jitted call

`online.Online.step` is all of it in one compiled function; the host split
runs the same functions in three (`online_host`).
"""

import functools

import jax
import jax.numpy as jnp

from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms import update as update_lib
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.rl import rollout as rollout_lib


def split_step_key(key):
  """(next state rng, rollout rng, update rng) of the step whose rng is
  `key`."""
  return tuple(jax.random.split(key, 3))


def step_rngs(state):
  """(next state rng, rollout rng, update rng) of a train step."""
  return split_step_key(state.rng)


def _by_parts(trainer, fn, prompt_tokens, responses=None, key=None):
  """`fn(prompts, responses, key)` over `online.rollout_microbatches` = P
  parts of the prompts, one after another (`jax.lax.map`), with the rows
  put back in prompt order.

  Part p takes prompts p, p + P, ... (`split_microbatches`), so each data
  shard's prompts feed every part and none move, with their k response rows
  of `responses` ([prompts * k, ...], adjacent per prompt) and the p-th of
  P keys split from `key`. `fn` returns response rows ([rows, ...] leaves)
  and scalars, which are added over the parts (the decode steps run)."""
  parts = trainer.config.online.rollout_microbatches
  if parts == 1:
    return fn(prompt_tokens, responses, key)
  k = trainer.online.samples_per_prompt

  def split_responses(x):
    # [prompts * k, ...] -> [P, prompts / P * k, ...], prompt-wise.
    grouped = update_lib.split_microbatches(
        x.reshape((-1, k) + x.shape[1:]), parts)
    return grouped.reshape((parts, -1) + x.shape[1:])

  xs = (update_lib.split_microbatches(prompt_tokens, parts),
        None if responses is None else split_responses(responses),
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


def sample(trainer, params, frozen, prompt_tokens, rng):
  """`samples_per_prompt` responses per prompt (adjacent rows), each prompt
  prefilled once for them: `sampling.Samples` [prompts * k, L]."""
  o, settings = trainer.config.online, trainer.online
  training = trainer.algorithm.training
  params, frozen = trainer.view_parts(params, frozen)  # LoRA: base + adapters
  sample_params = (training.sample_params(trainer, params, frozen)
                   if training.sample_params else params["policy"])

  def part(prompts, unused_responses, key):
    return rollout_lib.sample_responses(
        trainer.lm, sample_params, prompts, key,
        max_new_tokens=settings.max_new_tokens, temperature=o.temperature,
        eos_id=trainer.vocabulary.eos_id,
        num_samples=settings.samples_per_prompt,
        stop_when_done=o.stop_when_done, cache_segments=o.cache_segments)
  return _by_parts(trainer, part, prompt_tokens, key=rng)


def assemble(trainer, params, frozen, prompt_tokens, samples):
  """The rollout of sampled responses: truncated after their EOS, scored by
  the rewards computed in the step (the host rewards' columns NaN until
  `with_host_rewards` fills them), with policy and reference log-probs at
  the sampling temperature (the reference's only when a KL term weighs
  them: `kl_control.scores_reference`)."""
  o, k = trainer.config.online, trainer.online.samples_per_prompt
  uses_rm = reward_sources.uses_reward_model(trainer.config)
  names = list(reward_sources.weights(trainer.config))
  params, frozen = trainer.view_parts(params, frozen)  # LoRA: base + adapters
  reference = (frozen["reference"] if kl_control.scores_reference(trainer)
               else None)

  def part(prompts, tokens, unused_key):
    rollout = rollout_lib.assemble_rollout(
        trainer.lm, params["policy"], reference,
        reward_sources.reward_lm(trainer) if uses_rm else None,
        frozen.get("reward"), jnp.repeat(prompts, k, axis=0), tokens,
        temperature=o.temperature, eos_id=trainer.vocabulary.eos_id,
        missing_eos_penalty=o.missing_eos_penalty if o.eos_trick else None)
    device = reward_sources.device_rewards(trainer, frozen, rollout)
    missing = jnp.full(rollout.has_eos.shape, jnp.nan, jnp.float32)
    rewards = jnp.stack([device.get(name, missing) for name in names],
                        axis=1)
    return rollout.replace(rewards=rewards)

  rollout = _by_parts(trainer, part, prompt_tokens, samples.tokens)
  # (The rollout's own decode_steps are None: they are the samples'.)
  return rollout.replace(
      scores=reward_sources.combine(trainer, rollout.rewards),
      decode_steps=samples.num_steps)


def with_host_rewards(trainer, rollout, host_values):
  """The rollout with the host rewards [rows, num host rewards] in their
  columns, and its scores summed again."""
  names = list(reward_sources.weights(trainer.config))
  columns = [names.index(r.name)
             for r in reward_sources.host_rewards(trainer)]
  rewards = rollout.rewards.at[:, jnp.asarray(columns)].set(host_values)
  return rollout.replace(rewards=rewards,
                         scores=reward_sources.combine(trainer, rewards))


def make_rollout(trainer, params, frozen, prompt_tokens, rng):
  """Samples `samples_per_prompt` responses per prompt (adjacent rows) and
  scores them with the rewards computed in the step. prompt_tokens:
  [num_prompts, Lp]."""
  samples = sample(trainer, params, frozen, prompt_tokens, rng)
  return assemble(trainer, params, frozen, prompt_tokens, samples)


def rollout_for_step(trainer, state, batch):
  """The rollout `train_step(state, batch)` trains on (its device rewards;
  the host's are added by the step)."""
  _, rollout_rng, _ = step_rngs(state)
  return make_rollout(trainer, state.params, state.frozen,
                      batch[prompts_lib.PROMPT_FEATURE], rollout_rng)


def update(trainer, state, rollout, rng, token_weights=None):
  """What a step does with its rollout: the algorithm's targets, then the
  gradient updates on them.

  Args:
    token_weights: optional [rows, L] weights of each token's advantage
      (the truncated importance weights of an off-policy step:
      `online_overlap`).

  Returns:
    (params, opt_state, algorithm state, metrics).
  """
  training = trainer.algorithm.training
  # LoRA: the targets read the base with the adapters, the updates train
  # the adapters alone (`state.params`) through the same view.
  data, algorithm_state, target_metrics = training.targets(
      trainer, trainer.view(state), rollout)
  if token_weights is not None:
    advantages = data["advantages"]
    if advantages.ndim == 1:
      advantages = advantages[:, None]
    data = dict(data, advantages=advantages * token_weights)
  params, opt_state, metrics = run_updates(
      trainer, state, data,
      lambda params, minibatch: training.loss(
          trainer, trainer.view_parts(params, state.frozen)[0], minibatch,
          state.algorithm_state),
      rng)
  metrics.update(rollout_lib.rollout_metrics(
      rollout, kl_control.coefficient(state),
      trainer.config.online.kl_estimator,
      reference_scored=kl_control.scores_reference(trainer)))
  if not reward_sources.uses_reward_model(trainer.config):
    metrics.pop("raw_score")  # there is no reward model
  if rollout.rewards is not None:  # None: the reward model's score alone
    metrics.update(reward_sources.reward_metrics(trainer, rollout.rewards))
  metrics.update(target_metrics)
  return params, opt_state, algorithm_state, metrics


def finish_step(trainer, state, rollout, update_rng, next_rng,
                token_weights=None):
  """The updates on a scored rollout: the next train state and metrics."""
  params, opt_state, algorithm_state, metrics = update(
      trainer, state, rollout, update_rng, token_weights)
  metrics["learning_rate"] = trainer.learning_rate(state.step)
  return state.replace(step=state.step + 1, params=params,
                       opt_state=opt_state, algorithm_state=algorithm_state,
                       rng=next_rng), metrics


def token_count(trainer, minibatch):
  """Response tokens of a (micro-)batch: what a token-mean loss averages."""
  del trainer
  return jnp.sum(minibatch["response_mask"].astype(jnp.float32))


def response_count(trainer, minibatch):
  """Responses of a (micro-)batch: what a per-response loss averages."""
  del trainer
  return jnp.asarray(minibatch["response_mask"].shape[0], jnp.float32)


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
  count = functools.partial(training.loss_count or token_count, trainer)
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


def policy_logprobs(trainer, params, minibatch):
  """(log-probs, entropies, mask) [rows, L] of the minibatch's responses
  under the policy being trained, at the sampling temperature."""
  return rollout_lib.logprobs_and_entropy(
      trainer.lm, params["policy"], minibatch, None,
      trainer.config.online.temperature, trainer.online.max_new_tokens)

"""`Online`: the `Training` every online algorithm shares.

`Online(...)` is the `Training` of ppo, rloo, grpo, reinforce, reinforce_pp
and rejection_sampling: an algorithm supplies its targets and its minibatch
loss, and the step is shared (`iteration.online_step`): sample
`samples_per_prompt` responses per prompt, score them with the run's
rewards (`reward_sources`: a reward model, the task's gold reward,
programs of the text), take policy and reference log-probs at the sampling
temperature, then the algorithm's targets and `num_epochs` x
`num_minibatches` gradient updates. Its driver runs it whole in one
compiled function, around the host when rewards are computed there
(`host_split`), or with rollouts made on devices of their own, one step
ahead of the update with `online.off_policy_steps=1` (`overlap`). Both
architectures work: the policy and the reward model may each be T5 or
decoder-only; prompts are served encoder-style and `jaxrlhf.rl.rollout`
left-pads them inside the step for decoder-only models. Rollout arrays are
[rows, L] over response tokens either way, so the algorithms never branch
on architecture.

Micro-batching (`train.num_microbatches` = M): each minibatch update
accumulates gradients over M micro-batches, each weighted by its share of
what the loss averages over (`Online.loss_count`: response tokens for a
token mean, responses for a per-response mean), so the update is the whole
minibatch's; an unweighted mean of micro-batch token means would not be
(micro-batches hold different numbers of tokens).

What an algorithm carries between steps (the KL coefficient,
REINFORCE's running baseline: `Algorithm.carried`) is returned by its
targets and checkpointed with the rest of the state. The config group and
its checks are in `options`, the KL controller in `kl_control`.
"""

import dataclasses
import functools
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrlhf import console
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import optimizers
from jaxrlhf.algorithms import reference
from jaxrlhf.agents import environments
from jaxrlhf.algorithms.online import episode_step
from jaxrlhf.algorithms.online import host_split
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms.online import kl_control
from jaxrlhf.algorithms.online import options
from jaxrlhf.algorithms.online import overlap
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import teacher
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.rewards import learned_reward


class PromptSource:
  """An online run's prompts: their tokens, texts and extra columns (which
  host rewards read), read once when first asked for, and the stream of
  prompt batches over them that `Online.batches` starts (the one the loop
  iterates; dynamic sampling and the overlap read it ahead)."""

  def __init__(self, config, prompt_length: int):
    self._config, self._prompt_length = config, prompt_length
    self.stream: Optional[prompts_lib.PromptBatches] = None

  @functools.cached_property
  def prompts(self) -> prompts_lib.Prompts:
    c = self._config
    return prompts_lib.load_prompts(
        c.data.task, c.data.train_split, self._prompt_length,
        on_long=c.online.long_prompts, suffix=c.online.prompt_suffix)

  def batches(self, position: int) -> prompts_lib.PromptBatches:
    """This process's share of the prompt batches from batch `position`."""
    c = self._config
    self.stream = prompts_lib.PromptBatches(
        self.prompts.tokens, c.train.batch_size, c.seed, position)
    return self.stream


@dataclasses.dataclass
class OnlineSettings:
  """An online run's resolved settings (`trainer.online`), built once when
  the trainer is: its reward sources and its prompts."""
  samples_per_prompt: int
  num_epochs: int
  num_minibatches: int
  max_new_tokens: int
  # The columns of a rollout's per-token arrays: max_new_tokens, or an
  # episode's max_episode_tokens (`episode_step.episode_tokens`).
  response_length: int
  rewards: reward_sources.RewardSources
  prompt_source: PromptSource
  # The frozen teacher of distillation (`teacher`), or None.
  teacher: Optional[learned_reward.FrozenNetwork] = None
  # The sampler records its routing and the trainer replays it (a
  # mixture-of-experts policy with `online.router_replay`).
  router_replay: bool = False

  @property
  def updates_per_step(self) -> int:
    return self.num_epochs * self.num_minibatches


@dataclasses.dataclass(frozen=True)
class Online(base.Training):
  """Learning from the policy's own samples: each train step is one
  iteration of rollout -> targets -> updates (module docstring).

  Attributes:
    samples_per_prompt: responses per prompt when `online.samples_per_prompt`
      is unset (the group size of RLOO/GRPO).
    num_epochs: passes over each rollout when `online.num_epochs` is unset.
    targets: (trainer, state, rollout) -> (update rows {name: [rows, ...]},
      the algorithm state it carries to the next step, metrics): what the
      updates train on (PPO's advantages and returns; a group's advantages;
      the selected samples).
    loss: (trainer, params, minibatch, algorithm_state) -> (loss, metrics)
      of one update; algorithm_state is the step's carried state before
      this step changes it (GRPO's in-loss KL coefficient).
    loss_count: (config, minibatch) -> what the loss is a mean over, for
      the micro-batches' shares (default: response tokens).
    update_rows: (config, prompts per step, responses per step) -> rows the
      updates use (default: every response); refuses an impossible
      selection naming its own field.
    sample_params: (config, params, frozen) -> the parameters responses are
      sampled from (default: the policy).
    samples_reference: (config) -> whether `sample_params` reads
      frozen["reference"], which the run then keeps (`keeps_reference`).
    value_from_reward_model: trainable networks initialised from the reward
      model (PPO's value network, detail 22), or from the policy when the
      run has no reward model.
    dynamic_sampling: optional (config) -> the cap of sampling rounds of
      DAPO's dynamic sampling, or None when it is off (`host_split`).
    trains_on_rewards: whether it trains on `config.rewards` (distillation
      alone does not: its signal is the teacher's).
    sample: optional (trainer, sample_fn, params, frozen, prompts, key) ->
      `sampling.Samples`, the step's responses around the policy's
      samples `sample_fn(params, frozen, prompts, key)` (GKD mixes in the
      dataset's completions).
    reads_completions: whether its steps read the prompts' own
      completions (the task's targets, `prompts_lib.COMPLETIONS`): GKD.
  """
  samples_per_prompt: int
  num_epochs: int
  targets: Callable[..., Tuple[Any, Any, base.Metrics]]
  loss: Callable[..., Tuple[Any, base.Metrics]]
  loss_count: Optional[Callable[..., Any]] = None
  update_rows: Optional[Callable[[Any, int, int], int]] = None
  sample_params: Optional[Callable[..., base.Params]] = None
  samples_reference: Optional[Callable[[Any], bool]] = None
  value_from_reward_model: Tuple[str, ...] = ()
  dynamic_sampling: Optional[Callable[[Any], Optional[int]]] = None
  trains_on_rewards: bool = True
  sample: Optional[Callable[..., Any]] = None
  reads_completions: bool = False

  online = True

  def setup(self, trainer) -> None:
    config = trainer.config
    o = config.online
    max_new_tokens = options.resolve(o.max_new_tokens,
                                     config.data.targets_length)
    rewards = reward_sources.build(
        config, trainer.vocabulary, trainer.lm, trainer.platform,
        max_new_tokens, shapes_only=trainer.shapes_only,
        used=self.trains_on_rewards)
    distilled = teacher.build_teacher(config, trainer.vocabulary,
                                      trainer.platform, trainer.shapes_only)
    if not trainer.shapes_only:
      if rewards.weights:
        console.log(rewards.describe())
      if distilled is not None:
        console.log(teacher.describe(config, distilled))
    trainer.online = OnlineSettings(
        samples_per_prompt=options.resolve(o.samples_per_prompt,
                                           self.samples_per_prompt),
        num_epochs=options.resolve(o.num_epochs, self.num_epochs),
        num_minibatches=o.num_minibatches, max_new_tokens=max_new_tokens,
        response_length=(episode_step.episode_tokens(config, max_new_tokens)
                         if environments.episodic(o) else max_new_tokens),
        rewards=rewards,
        prompt_source=PromptSource(config, trainer.prompt_length),
        teacher=distilled,
        router_replay=options.replays_routes(config, trainer.lm.module))

  def check_rows(self, algorithm, config, data_parallel: int) -> None:
    options.check_rows(algorithm, config, data_parallel)

  def with_completions(self, config) -> bool:
    """Whether the batches carry the prompts' own completions: the
    algorithm reads them (GKD) or a pairwise judge does."""
    return self.reads_completions or (
        self.trains_on_rewards and reward_sources.reads_references(config))

  def batches(self, trainer, position: int):
    source = trainer.online.prompt_source
    stream = source.batches(position)
    if not self.with_completions(trainer.config):
      return stream
    return prompts_lib.WithColumn(
        stream, prompts_lib.COMPLETIONS,
        source.prompts.padded_completions(trainer.online.max_new_tokens))

  def batch_spec(self, trainer):
    spec = prompts_lib.prompt_batch_spec(trainer.config.train.batch_size,
                                         trainer.prompt_length)
    if self.with_completions(trainer.config):
      spec[prompts_lib.COMPLETIONS] = jax.ShapeDtypeStruct(
          (trainer.config.train.batch_size, trainer.online.max_new_tokens),
          jnp.int32)
    return spec

  def tokens_in(self, trainer, local_batch) -> int:
    """Sampled tokens, over all processes: a fixed number per response
    (detail 23; an episode's budget)."""
    settings = trainer.online
    rows = (len(local_batch[prompts_lib.PROMPT_FEATURE])
            * settings.samples_per_prompt)
    return rows * settings.response_length * jax.process_count()

  def loaded_networks(self, trainer, abstract_state):
    token_swap = trainer.hf_options()["token_swap"]
    return {**reward_sources.loaded_networks(trainer, abstract_state,
                                             self.value_from_reward_model),
            **reward_sources.loaded_judge(trainer.online.rewards.judge,
                                          abstract_state, token_swap),
            **teacher.loaded_networks(trainer.online.teacher, abstract_state,
                                      token_swap)}

  def optimizer(self, trainer, per_network, update_scales):
    """One optimizer per network with warm-up counted in updates, so that
    a schedule over train steps is unchanged by epochs x minibatches."""
    config, updates = trainer.config, trainer.online.updates_per_step
    per_network = per_network or {"policy": config.optimizer}
    return optimizers.make_network_optimizers(
        {name: optimizers.per_update_config(cfg, updates)
         for name, cfg in per_network.items()},
        config.train.num_steps * updates, update_scales)

  def learning_rate(self, trainer, step):
    config, updates = trainer.config, trainer.online.updates_per_step
    return optimizers.learning_rate_schedule(
        optimizers.per_update_config(config.optimizer, updates),
        config.train.num_steps * updates)(step * updates)

  def train_step_function(self, trainer):
    """`iteration.online_step` as its driver runs it: compiled whole, or,
    when the host must score the responses (or pick which groups to train
    on), split around the host (`host_split`), or, with sampler devices or
    off-policy steps, with rollouts made on the sampler (`overlap`); on
    multi-turn episodes, the same with the episodes' parts
    (`episode_step`)."""
    episodic = environments.episodic(trainer.config.online)
    if overlap.overlaps(trainer.config):
      return overlap.OverlappedStep(
          trainer, episode_step.EpisodeStep if episodic
          else host_split.HostSplitStep)
    if episodic:
      return episode_step.EpisodeStep(trainer)
    if host_split.needs_host(trainer):
      return host_split.HostSplitStep(trainer)
    return iteration.fused_step(trainer)


def keeps_reference(algorithm, config) -> bool:
  """Whether the run holds the frozen reference in its state: only when a
  step reads it, to score the samples for a KL term that weighs something
  (`kl_control.scores_reference`) or to sample from it
  (`Online.samples_reference`: rejection sampling's sample_from=
  'reference'). Otherwise (GRPO with kl_coef 0, DAPO, Dr. GRPO) the copy
  would only take memory: evaluation loads the starting policy afresh to
  compare with (`Trainer.reference_params`)."""
  training = algorithm.training
  return kl_control.scores_reference(algorithm, config) or bool(
      training.samples_reference and training.samples_reference(config))


def frozen_reference_and_reward(trainer, rng):
  """The frozen reference when the run keeps one (`keeps_reference`), the
  reward model when one is weighted, and the teacher when the run has one
  (`distill`)."""
  a, b, c = jax.random.split(rng, 3)
  kept = ({"reference": trainer.init_lm(a)}
          if keeps_reference(trainer.algorithm, trainer.config) else {})
  return {**kept, **reward_sources.frozen_networks(trainer, b),
          **teacher.frozen_networks(trainer, c)}


def policy_and_reference_checkpoints(trainer):
  """Where the policy (and the reference, when kept) start from."""
  paths = reference.policy_and_reference_checkpoints(trainer)
  if not keeps_reference(trainer.algorithm, trainer.config):
    paths.pop("frozen/reference", None)
  return paths


# The policy, its frozen reference (when a step reads it) and the frozen
# reward model (RLOO, GRPO, REINFORCE, rejection sampling; PPO adds its
# value network).
POLICY_REFERENCE_AND_REWARD = base.Networks(
    trainable=reference.policy, frozen=frozen_reference_and_reward,
    checkpoints=policy_and_reference_checkpoints, reference=True)

"""Online RL: one train step is one iteration of rollout -> targets -> updates.

  online_step(trainer, state, prompts)
    rollout  = sample `samples_per_prompt` responses per prompt from the
               policy (or the reference), score them with the frozen reward
               model (EOS trick) and take policy and reference log-probs at
               the sampling temperature           (`make_rollout`)
    targets  = what the algorithm trains on: PPO's advantages and returns,
               a group's advantages, the selected samples
                                                  (`Online.targets`)
    updates  = `num_epochs` passes of `num_minibatches` gradient updates
               over the targets' rows, all inside the one jitted step
                                                  (`run_updates`)

Everything is a function of the trainer and arrays; an algorithm supplies
its targets and its minibatch loss (`base.Online`). Both architectures work:
the policy and the reward model may each be T5 or decoder-only (the reward
model's architecture is its run's); prompts are served encoder-style and
`jaxrlhf.rl.rollout` left-pads them inside the step for decoder-only models.
Rollout arrays are [rows, L] over response tokens either way, so the
algorithms never branch on architecture.

Micro-batching (`train.num_microbatches` = M): each minibatch update
accumulates gradients over M micro-batches, each weighted by its share of
what the loss averages over (`Online.loss_count`: response tokens for a
token mean, responses for a per-response mean), so the update is the whole
minibatch's; an unweighted mean of micro-batch token means would not be
(micro-batches hold different numbers of tokens).

The frozen reward model is a jaxrlhf reward_model run
(`config.online.reward_model_checkpoint`), built with that run's own model
config, so it may be larger than the policy; its vocabulary must be the
policy's (checked at start-up). The train state's `algorithm_state` holds
small scalars an algorithm carries between steps (the adaptive KL
coefficient, REINFORCE's running baseline), checkpointed with the rest.
"""

import dataclasses
import functools
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import optimizers
from jaxrlhf.algorithms import pretrained
from jaxrlhf.algorithms import reference
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.algorithms import update as update_lib
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data import tasks as tasks_lib
from jaxrlhf.data import vocab
from jaxrlhf.eval import evaluation
from jaxrlhf.models import build_model
from jaxrlhf.models import heads
from jaxrlhf.models import scoring
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import reductions
from jaxrlhf.rl import rollout as rollout_lib

F = config_schema.Field

# "Table 7" is the PPO hyper-parameter table of "The N+ implementation
# details of RLHF with PPO" (Huang et al. 2024).
ONLINE = config_schema.Group(
    "online",
    "Online RL (ppo, rloo, grpo, reinforce, rejection_sampling): every "
    "train step samples responses to train.batch_size prompts of data.task "
    "from the policy, scores them with a frozen reward model and updates "
    "the policy; init.policy_checkpoint is the policy's start and the "
    "frozen reference.", [
        F("reward_model_checkpoint", "",
          "A jaxrlhf reward_model workdir: its latest params/reward scores "
          "rollouts (and initialises PPO's value network, detail 22). Its "
          "vocabulary must be the policy's. Required."),
        F("temperature", 0.7,
          "Sampling temperature of rollouts (Table 7: 0.7); the log-probs of "
          "PPO ratios and of the KL penalty are computed at the same "
          "temperature.", bounds=">0"),
        F("max_new_tokens", None,
          "Tokens sampled per response, a fixed number as in detail 23 (then "
          "cut after the first EOS); unset = data.targets_length.",
          type=int, bounds=">0"),
        F("eos_trick", True,
          "The EOS trick (detail 23): a response with no EOS scores "
          "missing_eos_penalty instead of the reward model's output (which "
          "is only valid at an EOS, detail 13). False keeps the score at the "
          "last token."),
        F("missing_eos_penalty", -1.0,
          "The score of a response without EOS under the EOS trick.",
          bounds=config_schema.ANY_NUMBER),
        F("kl_coef", 0.05,
          "beta of the KL(pi || reference) penalty folded into the reward "
          "(PPO per token; RLOO and REINFORCE per sequence); Table 7: 0.05. "
          "GRPO puts its KL in the loss instead, with grpo.kl_coef.",
          bounds=">=0"),
        F("kl_estimator", "k1",
          "Per-token KL estimator of the penalty: 'k1' (log ratio), 'k2', "
          "'k3' (jaxrlhf/rl/kl.py). It shapes the reward of ppo, rloo and "
          "reinforce; GRPO's loss always uses k3, so for grpo and "
          "rejection_sampling it only changes the logged rlhf_reward.",
          choices=kl_lib.KL_ESTIMATORS),
        F("adaptive_kl", False,
          "Adaptive KL coefficient (Ziegler et al. 2019): beta moves towards "
          "keeping the mean per-response KL at kl_target, by at most 20% of "
          "(responses per step / kl_horizon) per step. The coefficient is "
          "part of the checkpointed train state. With grpo it adapts "
          "grpo.kl_coef (the loss's KL weight); rejection_sampling has no KL "
          "term and ignores it."),
        F("kl_target", 6.0, "The adaptive controller's target KL.",
          bounds=">0"),
        F("kl_horizon", 10000, "The adaptive controller's horizon.",
          bounds=">0"),
        F("samples_per_prompt", None,
          "Responses per prompt (the group size k of RLOO/GRPO, N of "
          "rejection sampling); unset = the algorithm's default (1 for ppo "
          "and reinforce, 4 for rloo and grpo, 8 for rejection_sampling). A "
          "step trains on batch_size * k responses.", type=int, bounds=">0"),
        F("num_epochs", None,
          "Passes over each rollout batch; each pass reshuffles the "
          "rollouts. Unset = 4 for ppo (Table 7: K = 4) and rloo (as TRL's "
          "RLOO), 1 for the others.", type=int, bounds=">0"),
        F("num_minibatches", 1,
          "Minibatches (optimizer updates) per pass (Table 7: 1).",
          bounds=">0"),
        F("rollout_microbatches", 1,
          "Parts a step's rollout is sampled and scored in, one after "
          "another (each holds batch_size / this many prompts): the "
          "rollout's activations and KV caches shrink by about this factor "
          "(train.num_microbatches splits only the updates). The responses "
          "differ from an unsplit rollout's (each part draws its own random "
          "numbers) but are drawn from the same policy.", bounds=">0"),
        F("clip_eps", 0.2,
          "Policy ratio clipping epsilon (Table 7: 0.2); GRPO's lower "
          "epsilon.", bounds=">0"),
        F("pg_reduction", "sequence_sum",
          "RLOO and REINFORCE: how per-token losses become one scalar "
          "(jaxrlhf/rl/reductions.py); 'sequence_sum' treats the response as "
          "one action (RLHF book 11.1.3).",
          choices=reductions.LOSS_REDUCTIONS),
        F("long_prompts", "cut_paragraph",
          "Prompts longer than data.inputs_length: 'cut_paragraph' drops "
          "trailing paragraphs (from the last newline) until the prompt fits "
          "(detail 2; a prompt with no newline left is an error naming it); "
          "'raise' stops at start-up naming the first one.",
          choices=prompts_lib.LONG_PROMPT_POLICIES),
        F("prompt_suffix", "",
          "A prompt ending that cutting keeps (e.g. '\\n\\nTL;DR:'; a long "
          "prompt that does not end with it is an error naming it); '' = "
          "none (cut at the last newline)."),
    ])


def check_online(c) -> None:
  """What every online algorithm needs."""
  config_schema.require(
      c.model.dropout_rate == 0, "model.dropout_rate",
      f"{c.model.dropout_rate}: online RL needs deterministic log-probs (PPO "
      "details, detail 7: with dropout the ratios are not 1 before the first "
      "update); set it to 0.")
  config_schema.require(
      bool(c.online.reward_model_checkpoint),
      "online.reward_model_checkpoint",
      f"{c.algorithm} scores its samples with a trained reward model; set it "
      "to a reward_model run's workdir.")


def check_groups_of_two(c) -> None:
  """RLOO and GRPO compare the responses to one prompt."""
  config_schema.require(
      c.online.samples_per_prompt is None or c.online.samples_per_prompt >= 2,
      "online.samples_per_prompt",
      f"{c.algorithm} compares the responses to one prompt; it needs at "
      "least 2.")


def _resolve(value, default):
  return default if value is None else value


def check_rows(algorithm, config, data_parallel: int) -> None:
  """The prompts split over the data shards, the rows of an update into
  minibatches and micro-batches (`update.check_split`): from the config
  alone, so that a run is refused before anything is written."""
  training = algorithm.training
  batch = config.train.batch_size
  samples = _resolve(config.online.samples_per_prompt,
                     training.samples_per_prompt)
  minibatches = config.online.num_minibatches
  if batch % data_parallel:
    raise ValueError(
        f"config.train.batch_size: {batch} prompts per step cannot be split "
        f"over {data_parallel} data-parallel shards; use a multiple of "
        f"{data_parallel}.")
  total = batch * samples
  rows = training.update_rows(config, batch) if training.update_rows else total
  if not 1 <= rows <= total:
    raise ValueError(
        f"config.rejection_sampling.top_k: {rows} must be between 1 and the "
        f"{total} responses sampled per step.")
  if rows % minibatches:
    raise ValueError(
        f"config.online.num_minibatches: {rows} responses per step "
        f"(train.batch_size {batch} x {samples} per prompt"
        f"{'' if rows == total else ', selected'}) do not split into "
        f"{minibatches} equal minibatches.")
  per_minibatch = rows // minibatches
  parts = config.online.rollout_microbatches
  if batch % parts or (batch // parts) % data_parallel:
    raise ValueError(
        f"config.online.rollout_microbatches: {batch} prompts per step "
        f"(train.batch_size) must split into {parts} equal parts, each a "
        f"multiple of the {data_parallel} data-parallel shards; use a "
        f"divisor of {batch // data_parallel}.")
  update_lib.check_split(
      per_minibatch, config.train.num_microbatches, data_parallel,
      what=(f"each minibatch update of {config.algorithm} "
            f"({per_minibatch} responses: {rows} per step / "
            f"online.num_minibatches {minibatches})"),
      field="online.num_minibatches / config.train.num_microbatches")


@dataclasses.dataclass
class OnlineSettings:
  """An online run's resolved settings and its reward model."""
  samples_per_prompt: int
  num_epochs: int
  num_minibatches: int
  max_new_tokens: int
  reward_run: Optional[dict]

  @classmethod
  def create(cls, trainer) -> "OnlineSettings":
    o, training = trainer.config.online, trainer.algorithm.training
    return cls(
        samples_per_prompt=_resolve(o.samples_per_prompt,
                                    training.samples_per_prompt),
        num_epochs=_resolve(o.num_epochs, training.num_epochs),
        num_minibatches=o.num_minibatches,
        max_new_tokens=_resolve(o.max_new_tokens,
                                trainer.config.data.targets_length),
        reward_run=pretrained.run_config(o.reward_model_checkpoint))

  @property
  def updates_per_step(self) -> int:
    return self.num_epochs * self.num_minibatches

  def rollout_rows(self, num_prompts: int) -> int:
    return num_prompts * self.samples_per_prompt

  # --- prompts --------------------------------------------------------------

  def prompt_batches(self, config, position: int):
    o = config.online
    prompts = prompts_lib.load_prompts(
        config.data.task, config.data.train_split, config.data.inputs_length,
        on_long=o.long_prompts, suffix=o.prompt_suffix)
    return prompts_lib.PromptBatches(prompts.tokens, config.train.batch_size,
                                     config.seed, position)

  # --- optimisation ------------------------------------------------------------

  def make_optimizer(self, config, per_network, update_scales=None):
    """One optimizer per network with warm-up counted in updates, so that
    a schedule over train steps is unchanged by epochs x minibatches."""
    total = config.train.num_steps * self.updates_per_step
    per_network = per_network or {"policy": config.optimizer}
    return optimizers.make_network_optimizers(
        {name: optimizers.per_update_config(cfg, self.updates_per_step)
         for name, cfg in per_network.items()}, total, update_scales)

  def learning_rate(self, config, step):
    return optimizers.learning_rate_schedule(
        optimizers.per_update_config(config.optimizer,
                                     self.updates_per_step),
        config.train.num_steps * self.updates_per_step)(
            step * self.updates_per_step)

  # --- the reward model ---------------------------------------------------------

  def reward_model_networks(self, trainer, abstract_state):
    """{target: loaded tree} of the frozen reward model and the networks
    initialised from it, shaped and sharded as in `abstract_state`."""
    path = trainer.config.online.reward_model_checkpoint
    targets = ["frozen/reward"] + [
        f"params/{name}"
        for name in trainer.algorithm.training.value_from_reward_model]
    return {target: pretrained.load_network_params(
                path, state_lib.subtree(abstract_state, target), "reward")
            for target in targets}


def _reward_model(trainer) -> Tuple[Any, Any]:
  """(scoring adapter, model config) of the reward model, built once per
  trainer from its run's config."""

  def build():
    run = trainer.online.reward_run
    path = trainer.config.online.reward_model_checkpoint
    vocabulary = tasks_lib.run_vocabulary(run) if run else None
    if vocabulary is not None and (vocab.fingerprint(vocabulary)
                                   != vocab.fingerprint(trainer.vocabulary)):
      raise ValueError(
          f"config.online.reward_model_checkpoint: the reward model {path!r} "
          f"was trained with vocabulary {vocab.describe(vocabulary)}, but "
          f"the policy (config.data.task {trainer.config.data.task!r}) uses "
          f"{vocab.describe(trainer.vocabulary)}. Its scores of the policy's "
          "token ids would be meaningless: train a reward model on the "
          "policy's vocabulary.")
    model_config = trainer.config.model
    if run and "model" in run:
      # The reward model's own architecture and size: it may be T5 for a
      # decoder-only policy or the reverse (`rollout.response_features` lays
      # the responses out for each).
      model_config = ml_collections.ConfigDict(run["model"])
      if "arch" not in model_config:
        with model_config.unlocked():
          model_config.arch = "t5"  # runs from before decoder-only models
    module, module_config = build_model(model_config,
                                        trainer.vocabulary.vocab_size)
    return scoring.adapter_for(module), module_config

  return trainer.once("reward_model", build)


def reward_lm(trainer):
  """The reward model's scoring adapter (its run's architecture and size)."""
  return _reward_model(trainer)[0]


def init_reward_net(trainer, rng):
  """Fresh (boxed) reward-model-shaped params {"backbone", "head"}."""
  a, b = jax.random.split(rng)
  adapter, reward_config = _reward_model(trainer)
  backbone = trainer.init_lm(a, module=adapter.module)
  return heads.init_from_backbone(b, backbone, reward_config.emb_dim)


def frozen_reference_and_reward(trainer, rng):
  a, b = jax.random.split(rng)
  return {"reference": trainer.init_lm(a), "reward": init_reward_net(trainer, b)}


# The policy, its frozen reference and the frozen reward model (RLOO, GRPO,
# REINFORCE, rejection sampling; PPO adds its value network).
POLICY_REFERENCE_AND_REWARD = base.Networks(
    trainable=reference.policy, frozen=frozen_reference_and_reward,
    checkpoints=reference.policy_and_reference_checkpoints, reference=True)


# --- one RL iteration ------------------------------------------------------------


def make_rollout(trainer, params, frozen, prompt_tokens, rng):
  """Samples `samples_per_prompt` responses per prompt (adjacent rows) and
  scores them. prompt_tokens: [num_prompts, Lp].

  With `online.rollout_microbatches` = P > 1, P parts of the prompts are
  rolled out one after another (`jax.lax.map`) and their rows put back in
  prompt order. Part p takes prompts p, p + P, ... (`split_microbatches`),
  so each data shard's prompts feed every part and none move."""
  parts = trainer.config.online.rollout_microbatches
  if parts == 1:
    return _rollout_part(trainer, params, frozen, prompt_tokens, rng)
  per_part = jax.lax.map(
      lambda a: _rollout_part(trainer, params, frozen, *a),
      (update_lib.split_microbatches(prompt_tokens, parts),
       jax.random.split(rng, parts)))
  samples = trainer.online.samples_per_prompt

  def merge(x):
    # [P, prompts / P * k, ...] -> [prompts * k, ...]: prompt j * P + p's
    # k responses stay adjacent (group algorithms compare them).
    x = x.reshape((parts, x.shape[1] // samples, samples) + x.shape[2:])
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((-1,) + x.shape[3:])
  return jax.tree.map(merge, per_part)


def _rollout_part(trainer, params, frozen, prompt_tokens, rng):
  o, settings = trainer.config.online, trainer.online
  training = trainer.algorithm.training
  prompts = jnp.repeat(prompt_tokens, settings.samples_per_prompt, axis=0)
  sample_params = (training.sample_params(trainer, params, frozen)
                   if training.sample_params else params["policy"])
  tokens = rollout_lib.sample_responses(
      trainer.lm, sample_params, prompts, rng,
      max_new_tokens=settings.max_new_tokens, temperature=o.temperature,
      eos_id=trainer.vocabulary.eos_id)
  return rollout_lib.assemble_rollout(
      trainer.lm, params["policy"], frozen["reference"],
      reward_lm(trainer), frozen["reward"], prompts, tokens,
      temperature=o.temperature, eos_id=trainer.vocabulary.eos_id,
      missing_eos_penalty=o.missing_eos_penalty if o.eos_trick else None)


def step_rngs(state):
  """(next state rng, rollout rng, update rng) of a train step."""
  return tuple(jax.random.split(state.rng, 3))


def rollout_for_step(trainer, state, batch):
  """The rollout `train_step(state, batch)` trains on."""
  _, rollout_rng, _ = step_rngs(state)
  return make_rollout(trainer, state.params, state.frozen,
                      batch["encoder_input_tokens"], rollout_rng)


def update(trainer, state, rollout, rng):
  """What a step does with its rollout: the algorithm's targets, then the
  gradient updates on them.

  Returns:
    (params, opt_state, algorithm state, metrics).
  """
  training = trainer.algorithm.training
  data, algorithm_state, target_metrics = training.targets(trainer, state,
                                                           rollout)
  params, opt_state, metrics = run_updates(
      trainer, state, data,
      lambda params, minibatch: training.loss(trainer, params, minibatch,
                                              state.algorithm_state),
      rng)
  metrics.update(rollout_lib.rollout_metrics(
      rollout, state.algorithm_state["kl_coef"],
      trainer.config.online.kl_estimator))
  metrics.update(target_metrics)
  return params, opt_state, algorithm_state, metrics


def online_step(trainer, state, batch):
  """One RL iteration: rollout -> the algorithm's targets -> updates."""
  next_rng, rollout_rng, update_rng = step_rngs(state)
  rollout = make_rollout(trainer, state.params, state.frozen,
                         batch["encoder_input_tokens"], rollout_rng)
  params, opt_state, algorithm_state, metrics = update(trainer, state,
                                                       rollout, update_rng)
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


def next_kl_coef(trainer, kl_coef, rollout):
  """The KL controller: fixed, or Ziegler et al.'s adaptive update from the
  rollout's mean per-response KL."""
  o = trainer.config.online
  if not o.adaptive_kl:
    return kl_lib.fixed_kl_coef(kl_coef, None, None)
  observed = jnp.mean(kl_lib.sequence_kl(rollout.logprobs,
                                         rollout.ref_logprobs, rollout.mask,
                                         "k1"))
  return kl_lib.adaptive_kl_coef(kl_coef, observed, rollout.mask.shape[0],
                                 o.kl_target, o.kl_horizon)


def kl_coef_state(config) -> Dict[str, float]:
  """The carried state of a KL-penalised algorithm: its coefficient."""
  return {"kl_coef": float(config.online.kl_coef)}


def policy_logprobs(trainer, params, minibatch):
  """(log-probs, entropies, mask) [rows, L] of the minibatch's responses
  under the policy being trained, at the sampling temperature."""
  return rollout_lib.logprobs_and_entropy(
      trainer.lm, params["policy"], minibatch, None,
      trainer.config.online.temperature, trainer.online.max_new_tokens)


# --- evaluation ---------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _reward_fn(adapter):
  """Jitted reward-model scoring, shared by every run with the same reward
  model (the stages of a pipeline compile it once)."""
  return jax.jit(lambda params, batch: heads.sequence_rewards(adapter,
                                                              params, batch))


def reward_scores(trainer, reward_params, prompt_tokens,
                  samples) -> np.ndarray:
  """Reward-model scores of sampled completions (host arrays), with the EOS
  trick as in training. [n]."""
  reward_fn = _reward_fn(reward_lm(trainer))
  # Laid out for the reward model's architecture, which may not be the
  # policy's.
  features = jax.tree.map(np.asarray, rollout_lib.response_features(
      reward_lm(trainer), jnp.asarray(prompt_tokens),
      jnp.asarray(samples.tokens), jnp.asarray(samples.mask),
      trainer.vocabulary.eos_id))
  n = len(prompt_tokens)
  scores = np.concatenate([
      evaluation.local_rows(reward_fn(reward_params, b))
      for b in evaluation.global_batches(
          features, trainer.config.eval.batch_size, trainer.mesh,
          trainer.rules)])[:n]
  o = trainer.config.online
  if o.eos_trick:
    scores = np.where(np.asarray(samples.has_eos), scores,
                      o.missing_eos_penalty)
  return scores


def evaluate(trainer, state) -> Dict[str, float]:
  """The comparison with the reference, plus the reward model's mean score
  of the same policy samples (the proxy reward, to set against the gold
  reward when looking for over-optimisation)."""
  metrics = reference.against_reference(trainer, state)
  prompts = reference.eval_prompts(trainer)
  if prompts is None:
    return metrics
  tokens = prompts[0]
  cfg = trainer.config
  # The same seed as the first draw of compare_with_reference: the same
  # samples the gold reward judged.
  samples = evaluation.sample(trainer, state.params["policy"], tokens,
                              greedy=False, temperature=cfg.eval.temperature,
                              seed=cfg.seed)
  scores = reward_scores(trainer, state.frozen["reward"], tokens, samples)
  metrics["eval/reward_model_score"] = evaluation.global_mean(
      float(scores.sum()), len(scores))
  return metrics


EVALUATION = base.Evaluation(
    evaluate=evaluate, describe=reference.describe_against_reference,
    check=reference.check_eval_task)

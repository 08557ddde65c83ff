"""What the online RL recipes share: prompts, reward model, rollouts, updates.

An online recipe's train step is one RL iteration, all inside the jitted,
donated step: sample responses to a batch of prompts from the policy, score
them (`jaxrlhf.rl.rollout`), then several optimizer updates over minibatches
of the rollouts (`run_updates`, a `lax.scan` of guarded updates). Subclasses
(PPO, RLOO, GRPO, REINFORCE, rejection sampling) say which networks they
train and what one update's loss is.

Both architectures: the policy and the reward model may each be T5 or
decoder-only (the reward model's architecture is its run's); prompts are
served encoder-style and `jaxrlhf.rl.rollout` left-pads them inside the step
for decoder-only models. Rollout arrays are [rows, L] over response tokens
either way, so the algorithms never branch on architecture.

Micro-batching (`train.num_microbatches` = M): each minibatch update
accumulates gradients over M micro-batches (`steps.accumulate_gradients`),
so activation memory scales with minibatch / M rows while the update stays
that of the whole minibatch. Each micro-batch's loss is weighted by its
share of what the loss averages over (`loss_count`: response tokens for a
token mean, responses for a per-response mean), so the weighted sum equals
the minibatch loss; an unweighted mean of micro-batch token means would
not (micro-batches hold different numbers of tokens).

The frozen reward model is a jaxrlhf reward_model run
(`config.online.reward_model_checkpoint`), built with that run's own model
config, so it may be larger than the policy; its vocabulary must be the
policy's (checked at start-up). The train state adds `rl`, small scalars an
algorithm carries between steps (the adaptive KL coefficient, REINFORCE's
running baseline), checkpointed with everything else.

Prompts ("N+ implementation details", details 2 and 21): the prompt split is
read once; a prompt longer than `data.inputs_length` loses trailing
paragraphs until it fits (or is an error, per `online.long_prompts`); batches
walk through a fresh permutation of the split on every pass, without
replacement within a pass. (seqio's own shuffle does not do this: it
repeats the split, then shuffles through a 1000-example buffer, so no
example comes more than 1000 places before its file position, and passes
mix at their boundaries: of the first 3,000 examples served from a
3,000-example split, 339 were repeats.)
"""

import copy
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Tuple

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import seqio
import tensorflow as tf

from jaxrlhf import sharding
from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks as tasks_lib
from jaxrlhf.data import vocab
from jaxrlhf.eval import evaluation
from jaxrlhf.models import build_model
from jaxrlhf.models import heads
from jaxrlhf.models import scoring
from jaxrlhf.recipes import policy
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import rollout as rollout_lib
from jaxrlhf.train import optimizers
from jaxrlhf.train import pretrained
from jaxrlhf.train import state as state_lib
from jaxrlhf.train import steps

# --- prompts --------------------------------------------------------------------


class PromptTooLongError(ValueError):
  """A prompt does not fit `data.inputs_length`."""


def fit_prompt(text: str, encode: Callable[[str], List[int]], max_tokens: int,
               *, on_long: str = "cut_paragraph", suffix: str = "",
               separator: str = "\n") -> Tuple[List[int], int]:
  """Tokens of `text`, with trailing paragraphs dropped until it fits.

  Detail 2 of "N+ implementation details": a query over the limit is cut at
  its last paragraph break (the last newline) rather than mid-sentence, and
  again until it fits. A `suffix` the text ends with (e.g. "\\n\\nTL;DR:") is
  kept after the cut.

  Args:
    text: the prompt.
    encode: text -> token ids as the task stores them (EOS included if the
      task appends one).
    max_tokens: the limit.
    on_long: "cut_paragraph" or "raise".
    suffix: an ending kept through cuts.
    separator: the paragraph break.

  Returns:
    (tokens, number of paragraphs removed).

  Raises:
    PromptTooLongError: on_long is "raise" and the prompt is too long, or no
      paragraph break is left to cut at.
  """
  tokens = encode(text)
  if len(tokens) <= max_tokens:
    return tokens, 0
  if on_long == "raise":
    raise PromptTooLongError(f"it has {len(tokens)} tokens, more than "
                             f"{max_tokens}")
  if suffix and not text.endswith(suffix):
    suffix = ""
  body = text[:len(text) - len(suffix)]
  cuts = 0
  while len(tokens) > max_tokens:
    cut = body.rfind(separator)
    if cut <= 0:
      raise PromptTooLongError(
          f"it still has {len(tokens)} tokens, more than {max_tokens}, after "
          f"dropping {cuts} trailing paragraph(s), and no paragraph break "
          "is left to cut at")
    body = body[:cut].rstrip()
    cuts += 1
    tokens = encode(body + suffix)
  return tokens, cuts


@dataclasses.dataclass
class Prompts:
  """A split's prompts, fitted and padded."""
  tokens: np.ndarray  # [num_prompts, max_tokens] int32, 0-padded
  num_cut: int        # prompts that lost paragraphs


def _prompt_feature(task) -> str:
  features = task.output_features
  for name in ("inputs", "prompt"):
    if name in features:
      return name
  raise ValueError(
      f"config.data.task {task.name!r}: online RL reads prompts from an "
      f"'inputs' or 'prompt' feature; the task has {sorted(features)}.")


@functools.lru_cache(maxsize=8)
def _load_prompts(task, split: str, max_tokens: int, on_long: str,
                  suffix: str) -> Prompts:
  # The task object itself is the cache key (not its name or id(): the cache
  # keeps it alive, so a re-registered task is a new key and is re-read).
  task_name = task.name
  name = _prompt_feature(task)
  feature = task.output_features[name]
  vocabulary = feature.vocabulary
  eos = [vocabulary.eos_id] if feature.add_eos else []
  encode = lambda text: list(vocabulary.encode(text)) + eos
  rows, num_cut = [], 0
  text_key = f"{name}_pretokenized"
  ds = task.get_dataset(None, split=split, shuffle=False, num_epochs=1)
  ds = ds.map(lambda ex: {"tokens": ex[name], "length": tf.size(ex[name]),
                          "text": ex.get(text_key, "")})
  # Batched reading: per-example iteration costs more than the rest.
  examples = (
      (tokens[:length], text)
      for batch in ds.padded_batch(1024).as_numpy_iterator()
      for tokens, length, text in zip(batch["tokens"], batch["length"],
                                      batch["text"]))
  for index, (tokens, text) in enumerate(examples):
    if len(tokens) > max_tokens:
      text = text.decode()
      try:
        tokens, cuts = fit_prompt(text, encode, max_tokens, on_long=on_long,
                                  suffix=suffix)
      except PromptTooLongError as e:
        fixes = ("shorten or drop that row, or raise config.data."
                 "inputs_length" if on_long == "cut_paragraph" else
                 "set config.online.long_prompts='cut_paragraph' to drop "
                 "trailing paragraphs (detail 2), or raise "
                 "config.data.inputs_length")
        raise PromptTooLongError(
            f"config.data.task {task_name!r}, split {split!r}, row {index} "
            f"({text[:60]!r}...): {e} (config.data.inputs_length). "
            f"To fix: {fixes}.") from None
      num_cut += cuts > 0
    rows.append(np.asarray(tokens, np.int32))
  if not rows:
    raise ValueError(f"config.data.task {task_name!r} has no prompts in split "
                     f"{split!r}.")
  padded = np.zeros((len(rows), max_tokens), np.int32)
  for i, row in enumerate(rows):
    padded[i, :len(row)] = row
  return Prompts(padded, num_cut)


def load_prompts(config) -> Prompts:
  """The training prompts of `config.data.task` (cached per process)."""
  task = pipeline.get_task(config.data.task)
  o = config.online
  return _load_prompts(task, config.data.train_split,
                       config.data.inputs_length, o.long_prompts,
                       o.prompt_suffix)


class PromptBatches:
  """This process's share of consecutive global batches of prompts.

  The prompts are served as one stream: pass e is the permutation of the
  split drawn from (seed, e), and batch b is stream entries [b * B, (b + 1)
  * B) (detail 21: sample without replacement, reshuffle once the split is
  used up). The position is the number of batches served, so a resumed run
  continues with exactly the next batch.
  """

  def __init__(self, prompts: np.ndarray, global_batch_size: int, seed: int,
               position: int = 0):
    self.prompts = prompts
    self.global_batch_size = global_batch_size
    self.local_batch_size = pipeline.local_batch_size(global_batch_size)
    self.seed = seed
    self.position = position
    self._permutations: Dict[int, np.ndarray] = {}

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      if len(self._permutations) > 4:
        self._permutations.pop(min(self._permutations))
      rng = np.random.default_rng([self.seed, epoch])
      self._permutations[epoch] = rng.permutation(len(self.prompts))
    return self._permutations[epoch]

  def global_indices(self, position: int) -> np.ndarray:
    """Prompt indices of global batch `position`."""
    n = len(self.prompts)
    stream = np.arange(position * self.global_batch_size,
                       (position + 1) * self.global_batch_size)
    return np.array([self._permutation(int(s // n))[s % n] for s in stream])

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    indices = self.global_indices(self.position)
    start = jax.process_index() * self.local_batch_size
    local = indices[start:start + self.local_batch_size]
    self.position += 1
    return {"encoder_input_tokens": self.prompts[local]}


@functools.lru_cache(maxsize=None)
def _reward_fn(module):
  """Jitted reward-model scoring, shared by recipes with the same module (the
  stages of a pipeline compile it once)."""
  lm = scoring.adapter_for(module)
  return jax.jit(lambda params, batch: heads.sequence_rewards(lm, params,
                                                              batch))


# --- the train state ----------------------------------------------------------------


@flax.struct.dataclass
class OnlineTrainState(state_lib.TrainState):
  """TrainState plus `rl`: {name: scalar} an algorithm carries between
  steps (e.g. "kl_coef"); checkpointed with the rest."""
  rl: Any = None


def _resolve(value, default):
  return default if value is None else value


# --- the recipe -----------------------------------------------------------------------


class OnlineRecipe(policy.PolicyRecipe):
  """Base of the online recipes; subclasses define `update`."""

  data_kind = None
  # Resolved defaults of the placeholders `online.samples_per_prompt` and
  # `online.num_epochs` (see defaults.py).
  default_samples_per_prompt = 1
  default_num_epochs = 1

  def __init__(self, config, mesh):
    self.config = config
    o = config.online
    if not o.reward_model_checkpoint:
      raise ValueError(
          f"config.online.reward_model_checkpoint: {config.algorithm} scores "
          "its samples with a trained reward model; set it to a "
          "reward_model run's workdir.")
    self.samples_per_prompt = _resolve(o.samples_per_prompt,
                                       self.default_samples_per_prompt)
    self.num_epochs = _resolve(o.num_epochs, self.default_num_epochs)
    self.num_minibatches = o.num_minibatches
    self.max_new_tokens = _resolve(o.max_new_tokens, config.data.targets_length)
    self.reward_run = pretrained.run_config(o.reward_model_checkpoint)
    super().__init__(config, mesh)  # checks the rows (_check_batch_size)
    self._add_rl_state()

  def _check_rollout_rows(self, config):
    rows = self.rollout_rows(config.train.batch_size)
    if rows % self.num_minibatches:
      raise ValueError(
          f"config.online.num_minibatches: {rows} responses per step "
          f"(train.batch_size {config.train.batch_size} x "
          f"{self.samples_per_prompt} per prompt) do not split into "
          f"{self.num_minibatches} equal minibatches.")
    self._check_microbatches(config, rows)

  def _check_microbatches(self, config, update_rows: int):
    micro = config.train.num_microbatches
    per_minibatch = update_rows // self.num_minibatches
    if per_minibatch % micro:
      raise ValueError(
          f"config.train.num_microbatches: each minibatch update of "
          f"{config.algorithm} has {per_minibatch} responses ({update_rows} "
          f"per step / online.num_minibatches {self.num_minibatches}), which "
          f"do not split into {micro} equal micro-batches; choose a divisor "
          f"of {per_minibatch}.")
    # Each gradient is taken over one micro-batch (the minibatch when M = 1)
    # gathered inside the step. Its rows must split evenly over the data
    # shards: with uneven shards on a mesh with a model axis, XLA's
    # partitioned backward pass gave NaN gradients (so every update was
    # skipped as non-finite) while the loss itself was right.
    dp = sharding.data_parallel_size(self.mesh, self.rules)
    per_micro = per_minibatch // micro
    if per_micro % dp:
      raise ValueError(
          f"config.online.num_minibatches / config.train.num_microbatches: "
          f"each gradient of {config.algorithm} is taken over {per_micro} "
          f"responses ({update_rows} per step / {self.num_minibatches} "
          f"minibatches / {micro} micro-batches), which cannot be split "
          f"evenly over {dp} data-parallel shards. Use fewer minibatches or "
          f"micro-batches, or a larger train.batch_size, so that each holds "
          f"a multiple of {dp} responses.")

  def _check_batch_size(self):
    # Replaces the offline check: a step's batch is its prompts; the
    # responses its updates train on are checked by _check_rollout_rows.
    dp = sharding.data_parallel_size(self.mesh, self.rules)
    if self.config.train.batch_size % dp:
      raise ValueError(
          f"config.train.batch_size: {self.config.train.batch_size} prompts "
          f"per step cannot be split over {dp} data-parallel shards; use a "
          f"multiple of {dp}.")
    self._check_rollout_rows(self.config)

  def rollout_rows(self, num_prompts: int) -> int:
    return num_prompts * self.samples_per_prompt

  def update_rows(self, num_prompts: int) -> int:
    """hook: rows the updates iterate over (rejection sampling: fewer)."""
    return self.rollout_rows(num_prompts)

  # --- data ---------------------------------------------------------------------

  def make_feature_lengths(self):
    return {"inputs": self.config.data.inputs_length,
            "targets": self.config.data.targets_length}

  def make_feature_converter(self):
    return seqio.EncDecFeatureConverter(pack=False)

  def prompts(self) -> Prompts:
    return load_prompts(self.config)

  def train_batches(self, position: int):
    return PromptBatches(self.prompts().tokens, self.config.train.batch_size,
                         self.config.seed, position)

  def tokens_in(self, local_batch) -> int:
    """Tokens sampled per step (fixed-length generation, detail 23)."""
    rows = len(local_batch["encoder_input_tokens"]) * self.samples_per_prompt
    return rows * self.max_new_tokens * jax.process_count()

  # --- networks -------------------------------------------------------------------

  @functools.cached_property
  def reward_lm(self):
    """The reward model's scoring adapter, from its run's model config;
    checks that it reads the policy's vocabulary."""
    run = self.reward_run
    path = self.config.online.reward_model_checkpoint
    vocabulary = tasks_lib.run_vocabulary(run) if run else None
    if vocabulary is not None and (vocab.fingerprint(vocabulary)
                                   != vocab.fingerprint(self.vocabulary)):
      raise ValueError(
          f"config.online.reward_model_checkpoint: the reward model {path!r} "
          f"was trained with vocabulary {vocab.describe(vocabulary)}, "
          f"but the policy (config.data.task {self.config.data.task!r}) uses "
          f"{vocab.describe(self.vocabulary)}. Its scores of the "
          "policy's token ids would be meaningless: train a reward model on "
          "the policy's vocabulary.")
    model_config = self.config.model
    if run and "model" in run:
      # The reward model's own architecture and size: it may be T5 for a
      # decoder-only policy or the reverse (`rollout.response_features`
      # lays the responses out for each).
      model_config = ml_collections.ConfigDict(run["model"])
      if "arch" not in model_config:
        with model_config.unlocked():
          model_config.arch = "t5"  # runs from before decoder-only models
    module, module_config = build_model(model_config, self.vocabulary.vocab_size)
    self.reward_model_config = module_config
    return scoring.adapter_for(module)

  def init_reward_net(self, rng):
    """Fresh (boxed) reward-model-shaped params {"backbone", "head"}."""
    a, b = jax.random.split(rng)
    module = self.reward_lm.module
    inputs = self.config.data.inputs_length
    targets = self.config.data.targets_length
    if self.reward_lm.is_encoder_decoder:
      enc = jnp.ones((1, inputs), jnp.int32)
      dec = jnp.ones((1, targets), jnp.int32)
      backbone = module.init(a, enc, dec, dec)["params"]
    else:
      tokens = jnp.ones((1, inputs + targets), jnp.int32)
      backbone = module.init(a, tokens, jnp.arange(inputs + targets)[None],
                             tokens)["params"]
    return heads.init_from_backbone(b, backbone,
                                    self.reward_model_config.emb_dim)

  def init_frozen(self, rng):
    a, b = jax.random.split(rng)
    return {"reference": self.init_lm(a), "reward": self.init_reward_net(b)}

  def networks_from_reward_model(self) -> Tuple[str, ...]:
    """hook: trainable networks initialised from the reward model."""
    return ()

  def init_state(self):
    state = super().init_state()
    path = self.config.online.reward_model_checkpoint
    frozen = dict(state.frozen)
    frozen["reward"] = pretrained.load_network_params(path, frozen["reward"],
                                                      "reward")
    params = dict(state.params)
    for name in self.networks_from_reward_model():
      params[name] = pretrained.load_network_params(path, params[name],
                                                    "reward")
    return state.replace(params=params, frozen=frozen)

  # --- the train state with `rl` ----------------------------------------------------

  def init_rl_state(self) -> Dict[str, float]:
    """hook: {name: initial scalar} of the algorithm's carried state."""
    return {"kl_coef": float(self.config.online.kl_coef)}

  def _add_rl_state(self):
    base_init, base_shardings, base_abstract = (
        self._init, self.state_shardings, self.abstract_state)
    initial = self.init_rl_state()
    replicated = sharding.replicated(self.mesh)

    def fields(state):
      return {f.name: getattr(state, f.name)
              for f in dataclasses.fields(state_lib.TrainState)}

    def init(rng):
      rl = {k: jax.device_put(np.float32(v), replicated)
            for k, v in initial.items()}
      return OnlineTrainState(**fields(base_init(rng)), rl=rl)

    self._init = init
    self.state_shardings = OnlineTrainState(
        **fields(base_shardings), rl={k: replicated for k in initial})
    self.abstract_state = OnlineTrainState(
        **fields(base_abstract),
        rl={k: jax.ShapeDtypeStruct((), jnp.float32) for k in initial})
    batch_sharding = sharding.batch_sharding(self.mesh, self.rules, 1)
    self.train_step = jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, batch_sharding),
        out_shardings=(self.state_shardings, replicated),
        donate_argnums=0)

  # --- optimisation -------------------------------------------------------------------

  @property
  def updates_per_step(self) -> int:
    return self.num_epochs * self.num_minibatches

  def _per_update_optimizer_config(self, opt):
    """The optimizer config with warm-up counted in optimizer updates, so
    that a schedule over train steps is unchanged by epochs x minibatches."""
    opt = copy.deepcopy(opt)
    with opt.unlocked():
      opt.warmup_steps = opt.warmup_steps * self.updates_per_step
    return opt

  def optimizer_configs(self):
    return {"policy": self.config.optimizer}

  def make_optimizer(self):
    total = self.config.train.num_steps * self.updates_per_step
    transforms = {
        name: optimizers.make_optimizer(
            self._per_update_optimizer_config(cfg), total)
        for name, cfg in self.optimizer_configs().items()}
    return optax.multi_transform(transforms, {k: k for k in transforms})

  def learning_rate(self, step):
    return optimizers.learning_rate_schedule(
        self._per_update_optimizer_config(self.config.optimizer),
        self.config.train.num_steps * self.updates_per_step)(
            step * self.updates_per_step)

  # --- one RL iteration ----------------------------------------------------------------

  def sampling_params(self, params, frozen):
    """hook: the parameters responses are sampled from (the policy)."""
    del frozen
    return params["policy"]

  def make_rollout(self, params, frozen, prompt_tokens, rng):
    """Samples `samples_per_prompt` responses per prompt (adjacent rows)
    and scores them. prompt_tokens: [num_prompts, Lp]."""
    o = self.config.online
    prompts = jnp.repeat(prompt_tokens, self.samples_per_prompt, axis=0)
    tokens = rollout_lib.sample_responses(
        self.lm, self.sampling_params(params, frozen), prompts, rng,
        max_new_tokens=self.max_new_tokens, temperature=o.temperature,
        eos_id=self.vocabulary.eos_id)
    return rollout_lib.assemble_rollout(
        self.lm, params["policy"], frozen["reference"], self.reward_lm,
        frozen["reward"], prompts, tokens, temperature=o.temperature,
        eos_id=self.vocabulary.eos_id,
        missing_eos_penalty=o.missing_eos_penalty if o.eos_trick else None)

  def step_rngs(self, state):
    """(next state rng, rollout rng, update rng) of a train step."""
    return tuple(jax.random.split(state.rng, 3))

  def rollout_for_step(self, state, batch):
    """The rollout `train_step(state, batch)` trains on."""
    _, rollout_rng, _ = self.step_rngs(state)
    return self.make_rollout(state.params, state.frozen,
                             batch["encoder_input_tokens"], rollout_rng)

  def update(self, state, rollout, rng):
    """hook: (params, opt_state, rl state, metrics) after training on a
    rollout; usually `run_updates` with the algorithm's loss."""
    raise NotImplementedError

  def _train_step(self, state, batch):
    next_rng, rollout_rng, update_rng = self.step_rngs(state)
    rollout = self.make_rollout(state.params, state.frozen,
                                batch["encoder_input_tokens"], rollout_rng)
    params, opt_state, rl, metrics = self.update(state, rollout, update_rng)
    metrics = dict(metrics, learning_rate=self.learning_rate(state.step))
    return state.replace(step=state.step + 1, params=params,
                         opt_state=opt_state, rl=rl, rng=next_rng), metrics

  def loss_count(self, minibatch):
    """hook: what the update's loss is a mean over, in a (micro-)batch: the
    number of response tokens (token means, the default) or of responses.
    Micro-batch m's loss is weighted by count_m / count(minibatch)."""
    return jnp.sum(minibatch["response_mask"].astype(jnp.float32))

  def run_updates(self, state, data, loss_fn, rng, loss_count=None):
    """`num_epochs` passes of `num_minibatches` guarded updates over `data`.

    With `train.num_microbatches` M > 1 each update's gradient is
    accumulated over M micro-batches of its minibatch, each loss and metric
    weighted by `loss_count(micro) / loss_count(minibatch)`: the update is
    the minibatch's, to float rounding, whenever the loss is a mean over
    what `loss_count` counts (metrics that are not such means, e.g.
    explained variance, become weighted means of the micro-batches').

    Args:
      state: the train state (its params and opt_state are the start).
      data: {name: [rows, ...]} arrays the loss reads; every pass reshuffles
        the rows.
      loss_fn: (params, minibatch) -> (scalar loss, {metric: scalar}).
      rng: shuffling key.
      loss_count: (minibatch) -> scalar; default `self.loss_count`.

    Returns:
      (params, opt_state, metrics): metrics are means over the updates, with
      "nonfinite" the count of skipped (non-finite) updates.
    """
    rows = jax.tree.leaves(data)[0].shape[0]
    indices = rollout_lib.minibatch_indices(rng, rows, self.num_epochs,
                                            self.num_minibatches)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    micro = self.config.train.num_microbatches
    loss_count = loss_count or self.loss_count

    def minibatch_gradients(params, minibatch):
      if micro == 1:
        (loss, metrics), grads = grad_fn(params, minibatch)
        return loss, metrics, grads
      total = loss_count(minibatch)

      def weighted_loss(p, micro_batch, unused_rng):
        loss, metrics = loss_fn(p, micro_batch)
        share = loss_count(micro_batch) / jnp.where(total > 0, total, 1.0)
        return loss * share, jax.tree.map(lambda m: m * share, metrics)

      # Nothing is random in a loss here; the key only feeds the signature.
      return steps.accumulate_gradients(weighted_loss, params, minibatch,
                                        jax.random.PRNGKey(0), micro)

    def one_update(carry, minibatch_rows):
      params, opt_state = carry
      minibatch = jax.tree.map(lambda x: jnp.take(x, minibatch_rows, axis=0),
                               data)
      loss, metrics, grads = minibatch_gradients(params, minibatch)
      params, opt_state, out = steps.guarded_update(
          state.replace(params=params, opt_state=opt_state), grads, loss,
          self.tx, metrics)
      return (params, opt_state), out

    (params, opt_state), per_update = jax.lax.scan(
        one_update, (state.params, state.opt_state), indices)
    metrics = {k: (jnp.sum(v) if k == "nonfinite" else jnp.mean(v))
               for k, v in per_update.items()}
    return params, opt_state, metrics

  def next_kl_coef(self, kl_coef, rollout):
    """The KL controller: fixed, or Ziegler et al.'s adaptive update from
    the rollout's mean per-response KL."""
    o = self.config.online
    if not o.adaptive_kl:
      return kl_lib.fixed_kl_coef(kl_coef, None, None)
    observed = jnp.mean(kl_lib.sequence_kl(rollout.logprobs,
                                           rollout.ref_logprobs, rollout.mask,
                                           "k1"))
    return kl_lib.adaptive_kl_coef(kl_coef, observed,
                                   rollout.mask.shape[0], o.kl_target,
                                   o.kl_horizon)

  def policy_logprobs(self, params, minibatch):
    """(log-probs, entropies, mask) [rows, L] of the minibatch's responses
    under the policy being trained, at the sampling temperature."""
    return rollout_lib.logprobs_and_entropy(
        self.lm, params["policy"], minibatch, None,
        self.config.online.temperature, self.max_new_tokens)

  # --- evaluation ------------------------------------------------------------------------

  def reward_scores(self, reward_params, prompt_tokens,
                    samples) -> np.ndarray:
    """Reward-model scores of sampled completions (host arrays), with the
    EOS trick as in training. [n]."""
    reward_fn = _reward_fn(self.reward_lm.module)
    # Laid out for the reward model's architecture, which may not be the
    # policy's.
    features = jax.tree.map(np.asarray, rollout_lib.response_features(
        self.reward_lm, jnp.asarray(prompt_tokens),
        jnp.asarray(samples.tokens), jnp.asarray(samples.mask),
        self.vocabulary.eos_id))
    n = len(prompt_tokens)
    scores = np.concatenate([
        evaluation.local_rows(reward_fn(reward_params, b))
        for b in evaluation.global_batches(
            features, self.config.eval.batch_size, self.mesh, self.rules)])[:n]
    o = self.config.online
    if o.eos_trick:
      scores = np.where(np.asarray(samples.has_eos), scores,
                        o.missing_eos_penalty)
    return scores

  def evaluate(self, state) -> Dict[str, float]:
    """The policy recipes' comparison with the reference, plus the reward
    model's mean score of the same policy samples (the proxy reward, to set
    against the gold reward when looking for over-optimisation)."""
    metrics = super().evaluate(state)
    prompts = self._eval_prompts()
    if prompts is None:
      return metrics
    tokens = prompts[0]
    cfg = self.config
    # The same seed as the first draw of compare_with_reference: the same
    # samples the gold reward judged.
    samples = evaluation.sample(self, state.params["policy"], tokens,
                                greedy=False, temperature=cfg.eval.temperature,
                                seed=cfg.seed)
    scores = self.reward_scores(state.frozen["reward"], tokens, samples)
    metrics["eval/reward_model_score"] = evaluation.global_mean(
        float(scores.sum()), len(scores))
    return metrics

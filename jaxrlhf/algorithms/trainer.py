"""A run of one algorithm: the shared parts around an `Algorithm` value.

`Trainer(algorithm, config, mesh)` builds, once, what every algorithm needs
and none defines: the task and its vocabulary, the model and its scoring
adapter, the feature layout, the optimizer(s), the sharded train state and
its initialisation, and the jitted train step, compiled once. The
algorithm's own functions (`jaxrlhf.algorithms.base`) receive the trainer
and read these parts. The loop (`jaxrlhf.train.loop`) drives a trainer
through `init_state`, `train_batches`, `train_step`, `evaluate` and
`finish_training`.
"""

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import seqio

from jaxrlhf import sharding
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import online as online_lib
from jaxrlhf.algorithms import optimizers
from jaxrlhf.algorithms import pretrained
from jaxrlhf.algorithms import reference
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.algorithms import update
from jaxrlhf.data import alignment_data
from jaxrlhf.data import feature_converters
from jaxrlhf.data import file_tasks
from jaxrlhf.data import pipeline
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data import tasks
from jaxrlhf.data import vocab
from jaxrlhf.models import build_model
from jaxrlhf.models import planned_vocab_size
from jaxrlhf.models import scoring


class Trainer:
  """The shared parts of a run; see the module docstring.

  Attributes:
    algorithm: the `base.Algorithm`.
    config, mesh, rules, workdir: the run's.
    vocabulary: the task's seqio vocabulary.
    model, model_config, lm: the policy's Flax module, its dataclass config
      and its scoring adapter; `architecture` is "encoder_decoder" or
      "decoder_only".
    feature_lengths, feature_converter: how batches are laid out.
    tx: the optax optimizer of all trained networks.
    online: `online.OnlineSettings` of an online algorithm, else None.
    state_shardings, abstract_state: of the train state.
    train_step: the jitted (state, batch) -> (state, metrics).
    shapes_only: built from the config alone, to lay out and compile the
      step (`jaxrlhf.plan`): no data file, vocabulary file or checkpoint is
      read, and the trainer cannot train or evaluate.
  """

  def __init__(self, algorithm: base.Algorithm, config, mesh,
               workdir: Optional[str] = None, shapes_only: bool = False):
    self.algorithm = algorithm
    for check in algorithm.checks:
      check(config)
    self.config = config
    self.mesh = mesh
    self.rules = sharding.as_rules(config.sharding.logical_axis_rules)
    # Where files beside the checkpoints go (precomputed reference
    # log-probs); None for a trainer that only scores or samples.
    self.workdir = workdir
    self.shapes_only = shapes_only
    pipeline.import_task_modules(config.data.task_modules)
    if shapes_only and config.data.files.vocabulary:
      # The file may be anywhere, gs:// included: a plan lays the model
      # out at the size the config or its preset gives.
      self.vocabulary = vocab.SizeOnlyVocabulary(
          planned_vocab_size(config.model))
    elif shapes_only and config.data.files.train:
      self.vocabulary = file_tasks.files_vocabulary(config)  # built in
    else:
      if config.data.files.train:
        file_tasks.register_task_from_files(config, files_kind(algorithm))
      features = pipeline.get_task(config.data.task).output_features
      feature = (features.get("targets") or features.get("prompt")
                 or next(iter(features.values())))
      self.vocabulary = feature.vocabulary
    self.model, self.model_config = build_model(config.model,
                                                self.vocabulary.vocab_size)
    self.lm = scoring.adapter_for(self.model)
    self.architecture = ("encoder_decoder" if self.lm.is_encoder_decoder
                         else "decoder_only")
    self.feature_lengths = (algorithm.feature_lengths(self)
                            if algorithm.feature_lengths
                            else self._default_feature_lengths())
    self.feature_converter = (algorithm.feature_converter(self)
                              if algorithm.feature_converter
                              else self._default_feature_converter())
    self.online = None
    if algorithm.online:
      self.online = online_lib.OnlineSettings.create(self)
    self.precomputed_reference = (
        config.reference_logprobs.mode == "precomputed")
    self._reference_table = None
    self._once = {}
    if algorithm.evaluation.check and not shapes_only:
      algorithm.evaluation.check(self)
    self.tx = self._make_optimizer()
    self._check_rows()
    algorithm_state = (algorithm.training.algorithm_state(config)
                       if self.online and algorithm.training.algorithm_state
                       else {})
    self._init, self.state_shardings, self.abstract_state = (
        state_lib.make_sharded_init(self._init_networks, self.tx, mesh,
                                    self.rules, algorithm_state))
    # The running sum of micro-batch gradients, split over the data shards.
    self.accumulator_shardings = sharding.spread_over_batch_axes(
        self.abstract_state.params, self.state_shardings.params, mesh,
        self.rules)
    batch_sharding = sharding.batch_sharding(self.mesh, self.rules, 1)
    self.train_step = jax.jit(
        self._step, in_shardings=(self.state_shardings, batch_sharding),
        out_shardings=(self.state_shardings, sharding.replicated(mesh)),
        donate_argnums=0)

  # --- data --------------------------------------------------------------------

  def _default_feature_lengths(self) -> Dict[str, int]:
    data = self.config.data
    if self.algorithm.data in (base.SFT_DATA, base.PROMPTS):
      return {"inputs": data.inputs_length, "targets": data.targets_length}
    kind = alignment_data.get_kind(self.algorithm.data)
    lengths = {"prompt": data.inputs_length}
    for field in kind.completion_fields:
      lengths[field] = data.targets_length
    return lengths

  def converter_options(self) -> Dict[str, Any]:
    """Keyword arguments of the decoder-only feature converters."""
    return ({} if self.lm.is_encoder_decoder
            else {"eos_id": self.vocabulary.eos_id})

  def _default_feature_converter(self):
    if self.algorithm.data == base.PROMPTS:
      return seqio.EncDecFeatureConverter(pack=False)
    if self.algorithm.data == base.SFT_DATA:
      return feature_converters.sft_feature_converter(
          self.architecture, **self.converter_options())
    return alignment_data.feature_converter_for(
        self.algorithm.data, self.architecture, **self.converter_options())

  def train_batches(self, position: int):
    """This process's share of consecutive training batches from batch
    `position` on (an iterator with a `position` attribute)."""
    if self.online:
      return self.online.prompt_batches(self.config, position)
    batches = pipeline.BatchIterator(
        self.config.data.task, self.config.data.train_split,
        self.feature_lengths, self.feature_converter,
        self.config.train.batch_size, seed=self.config.seed, shuffle=True,
        position=position)
    if self.precomputed_reference:
      return reference.with_precomputed_logprobs(self, batches)
    return batches

  def batch_spec(self) -> Dict[str, jax.ShapeDtypeStruct]:
    """The global shape and dtype of each feature of a training batch, from
    the config alone (no data is read): what `train_step` is compiled for."""
    batch = self.config.train.batch_size
    if self.online:
      return prompts_lib.prompt_batch_spec(batch,
                                           self.config.data.inputs_length)
    kind = (None if self.algorithm.data == base.SFT_DATA
            else self.algorithm.data)
    spec = {name: jax.ShapeDtypeStruct((batch,) + tuple(s.shape),
                                       s.dtype.as_numpy_dtype)
            for name, s in feature_converters.output_spec(
                self.feature_converter, kind, self.feature_lengths).items()}
    if self.precomputed_reference:
      spec.update(reference.precomputed_spec(self, batch))
    return spec

  def tokens_in(self, local_batch) -> int:
    """Tokens a train step learns from, over all processes (tokens/s):
    completion tokens offline, sampled tokens online (a fixed number per
    response, detail 23)."""
    if self.online:
      rows = (len(local_batch["encoder_input_tokens"])
              * self.online.samples_per_prompt)
      return rows * self.online.max_new_tokens * jax.process_count()
    n = sum(int(np.sum(v)) for k, v in local_batch.items()
            if k.endswith("loss_weights"))
    return n * jax.process_count()

  def _check_rows(self):
    check_rows(self.algorithm, self.config,
               sharding.data_parallel_size(self.mesh, self.rules))

  # --- networks ----------------------------------------------------------------

  def init_lm(self, rng, module=None):
    """Fresh (boxed) parameters of the configured language model, or of
    `module` (e.g. a reward model of another architecture)."""
    module = module or self.model
    lm = scoring.adapter_for(module)
    inputs, targets = (self.config.data.inputs_length,
                       self.config.data.targets_length)
    if lm.is_encoder_decoder:
      enc = jnp.ones((1, inputs), jnp.int32)
      dec = jnp.ones((1, targets), jnp.int32)
      return module.init(rng, enc, dec, dec)["params"]
    tokens = jnp.ones((1, inputs + targets), jnp.int32)
    return module.init(rng, tokens, jnp.arange(inputs + targets)[None],
                       tokens)["params"]

  def _init_networks(self, rng):
    a, b = jax.random.split(rng)
    networks = self.algorithm.networks
    return networks.trainable(self, a), networks.frozen(self, b)

  def init_state(self):
    """A new run's train state: the checkpoints its networks start from
    (`Networks.checkpoints`, and what an online algorithm reads from the
    reward model), then a random initialisation of the networks no
    checkpoint fills (the others are never initialised)."""
    abstract = state_lib.abstract_with_shardings(self.abstract_state,
                                                 self.state_shardings)
    loaded = {}
    for target, path in self.algorithm.networks.checkpoints(self).items():
      if not path:
        continue
      try:
        self._check_checkpoint_vocabulary(target, path)
        loaded[target] = pretrained.load_lm_params(
            path, state_lib.subtree(abstract, target), **self._hf_options())
      except ValueError as e:
        raise ValueError(f"{self._config_field_of(path)}: {e}") from None
    if self.online:
      loaded.update(self.online.reward_model_networks(self, abstract))
    state = self._init(jax.random.PRNGKey(self.config.seed), loaded)
    if self.precomputed_reference:
      # A new run's policy is the reference: score with it rather than
      # load the checkpoint a second time.
      reference.prepare_table(self, lambda: state.params["policy"],
                              new_run=True)
    return state

  def initial_policy_params(self):
    """The policy as a new run starts it, loaded afresh (the reference of a
    run that keeps none in its state)."""
    path = self.algorithm.networks.checkpoints(self).get("params/policy")
    if not path:
      return self._init(jax.random.PRNGKey(self.config.seed)).params["policy"]
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        self.abstract_state.params["policy"],
        self.state_shardings.params["policy"])
    return pretrained.load_lm_params(path, target, **self._hf_options())

  def _hf_options(self):
    """What a Hugging Face checkpoint needs to load into this run: the model,
    and the ids the vocabulary exchanges (`hf_tokenizer`)."""
    return {"module": self.model,
            "token_swap": getattr(self.vocabulary, "token_swap", None)}

  def reference_params(self, state):
    """The frozen reference policy: in the state, or loaded when the run
    keeps none there (precomputed reference log-probs, reference-free
    losses)."""
    if "reference" in state.frozen:
      return state.frozen["reference"]
    return self.initial_policy_params()

  def _config_field_of(self, path: str) -> str:
    """The config field ("config.init.policy_checkpoint", ...) that holds
    the checkpoint `path`, for error messages."""
    fields = []

    def visit(node, prefix):
      for key, value in node.items():
        if hasattr(value, "items"):
          visit(value, f"{prefix}{key}.")
        elif value == path and key.endswith("checkpoint"):
          fields.append(f"config.{prefix}{key}")

    visit(self.config, "")
    return " / ".join(fields) or f"checkpoint {path!r}"

  def _check_checkpoint_vocabulary(self, target: str, path: str):
    """A jaxrlhf checkpoint must have been trained on this run's vocabulary:
    otherwise its shapes may still fit (vocabularies are padded to the same
    size) while every token id means another token. T5X checkpoints carry
    no run config and are not checked."""
    run = pretrained.run_config(path)
    trained = tasks.run_vocabulary(run) if run else None
    if trained is None or vocab.fingerprint(trained) == vocab.fingerprint(
        self.vocabulary):
      return
    raise ValueError(
        f"The checkpoint {path!r} (loaded into {target}) was trained with "
        f"vocabulary {vocab.describe(trained)}, but this run's data "
        f"(config.data.task {self.config.data.task!r}) uses "
        f"{vocab.describe(self.vocabulary)}, so its token ids would be read "
        "as other tokens. Use data with the checkpoint's vocabulary "
        "(config.data.files.vocabulary for files) or a checkpoint trained "
        "on this one.")

  # --- optimisation ------------------------------------------------------------

  def _make_optimizer(self):
    networks = self.algorithm.networks
    per_network = networks.optimizers(self) if networks.optimizers else None
    scales = networks.update_scales(self) if networks.update_scales else None
    self._policy_update_scale = (scales or {}).get("policy", 1.0)
    if self.online:
      return self.online.make_optimizer(self.config, per_network, scales)
    steps_total = self.config.train.num_steps
    if not per_network:
      if scales:
        raise ValueError(f"{self.algorithm.name}: Networks.update_scales "
                         "needs Networks.optimizers (one optimizer per "
                         "network).")
      return optimizers.make_optimizer(self.config.optimizer, steps_total)
    return optimizers.make_network_optimizers(per_network, steps_total, scales)

  def learning_rate(self, step):
    """The policy's learning rate at train step `step`, times the factor its
    updates are scaled by (`Networks.update_scales`: DRO-V's 1/tau)."""
    if self.online:
      rate = self.online.learning_rate(self.config, step)
    else:
      rate = optimizers.learning_rate_schedule(
          self.config.optimizer, self.config.train.num_steps)(step)
    if self._policy_update_scale == 1:
      return rate
    return rate * self._policy_update_scale

  def _step(self, state, batch):
    if self.online:
      return online_lib.online_step(self, state, batch)
    return self._offline_step(state, batch)

  def _offline_step(self, state, batch):
    training = self.algorithm.training
    rng, step_rng = jax.random.split(state.rng)
    micro = self.config.train.num_microbatches

    def loss_fn(params, mb, mb_rng):
      return training.loss(self, params, state.frozen, mb, mb_rng)

    if training.share is None:
      share = update.mean_over_examples(loss_fn, micro)
    else:
      share = training.share(self, loss_fn, batch)
    params, opt_state, metrics = update.gradient_update(
        self.tx, state.params, state.opt_state, batch, step_rng, share, micro,
        self.accumulator_shardings)
    metrics["learning_rate"] = self.learning_rate(state.step)
    return state.replace(step=state.step + 1, params=params,
                         opt_state=opt_state, rng=rng), metrics

  # --- the end and evaluation ---------------------------------------------------

  def finish_training(self, state) -> Tuple[Any, Dict[str, float]]:
    """(the state the final checkpoint holds, metrics logged with the last
    step); the loop calls it once, after the last train step."""
    if self.algorithm.finish is None:
      return state, {}
    return self.algorithm.finish(self, state)

  def evaluate(self, state) -> Dict[str, float]:
    """Evaluation metrics ("eval/..." keys)."""
    return self.algorithm.evaluation.evaluate(self, state)

  def evaluation_description(self) -> str:
    """What `evaluate` measures on, for the console lines."""
    return self.algorithm.evaluation.describe(self)

  def once(self, key: str, make):
    """`make()` the first time this run asks for `key`, the same value
    after: held-out examples read once, evaluation functions jitted once."""
    if key not in self._once:
      self._once[key] = make()
    return self._once[key]


def files_kind(algorithm: base.Algorithm) -> str:
  """What config.data.files hold for `algorithm`: its alignment kind, or
  demonstrations (prompt and reference completion) for SFT and the prompts
  of online RL."""
  if algorithm.data in (base.SFT_DATA, base.PROMPTS):
    return file_tasks.DEMONSTRATIONS
  return algorithm.data


def check_rows(algorithm: base.Algorithm, config, data_parallel: int) -> None:
  """Each update's rows split into the micro-batches and over the
  data-parallel shards; from the config alone (the loop checks it before
  anything is written, the trainer again when built)."""
  if algorithm.online:
    online_lib.check_rows(algorithm, config, data_parallel)
    return
  batch = config.train.batch_size
  estimated = algorithm.whole_batch_statistic(config)
  if estimated and config.train.num_microbatches > 1:
    raise ValueError(
        f"config.train.num_microbatches: {algorithm.name} estimates "
        f"{estimated} from the whole batch; micro-batches would estimate it "
        "from each micro-batch and change the loss. Keep it at 1 and fit "
        "memory with model.remat_policy or the fully sharded rules "
        "(jaxrlhf.sharding.FULLY_SHARDED_RULES).")
  update.check_split(batch, config.train.num_microbatches, data_parallel,
                     what=f"train.batch_size {batch}",
                     field="train.batch_size")


"""A run of one algorithm: the shared parts around an `Algorithm` value.

`Trainer(algorithm, config, mesh)` builds, once, what every algorithm needs
and none defines: the task and its vocabulary, the model and its scoring
adapter, the feature layout, the optimizer(s), the sharded train state and
its initialisation, and the jitted train step, compiled once. The
algorithm's own functions (`jaxrlhf.algorithms.base`) receive the trainer
and read these parts; what differs between learning from a dataset and
learning from the policy's own samples is the algorithm's `Training`
(`offline.Offline`, `online.Online`), which the trainer calls without asking
which one it is. The loop (`jaxrlhf.train.loop`) drives a trainer through
`init_state`, `train_batches`, `train_step`, `evaluate` and
`finish_training`.
"""

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrlhf import sharding
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import lora_state
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import shapes
from jaxrlhf.data import vocab
from jaxrlhf.models import pretrained
from jaxrlhf.models import scoring
from jaxrlhf.models.registry import build_model
from jaxrlhf.models.registry import planned_vocab_size
from jaxrlhf.models.registry import prompt_feature_length


class Trainer:
  """The shared parts of a run; see the module docstring.

  Attributes:
    algorithm: the `base.Algorithm`.
    config, mesh, rules, workdir: the run's.
    vocabulary: the task's seqio vocabulary (a shapes-only trainer's is
      usually a `vocab.SizeOnlyVocabulary`: `planned_vocabulary`).
    model, model_config, lm: the policy's Flax module, its dataclass config
      and its scoring adapter; `architecture` is "encoder_decoder" or
      "decoder_only".
    feature_lengths, feature_converter: how batches are laid out (a
      shapes-only trainer has no converter: `data.shapes` lays its batches
      out).
    tx: the optax optimizer of all trained networks.
    online: `online.OnlineSettings` of an online algorithm, else None.
    precomputed_reference: the offline run's `PrecomputedReference` when
      `reference_logprobs.mode` is "precomputed", else None.
    lora: the run's `lora_state.LoraRun` when `config.lora.rank` > 0 (the
      trained networks are adapters on a frozen base; `view` is the state
      the algorithms read), else None.
    state_shardings, abstract_state: of the train state.
    train_step: (state, batch) -> (state, metrics): the algorithm's step
      compiled once (its `Training.train_step_function`).
    shapes_only: built from the config alone, to lay out and compile the
      step (`jaxrlhf.plan`): no data file, vocabulary file or checkpoint is
      read, the data stack (TensorFlow, seqio) is not loaded unless the
      vocabulary's size is only known to a task's seqio registration
      (`planned_vocabulary`), and the trainer cannot train or evaluate.
    evaluate: False builds a trainer that never judges its policy (what its
      evaluation would read is not checked; `evaluate` returns {}).
  """

  def __init__(self, algorithm: base.Algorithm, config, mesh,
               workdir: Optional[str] = None, shapes_only: bool = False,
               evaluate: bool = True):
    self.algorithm = algorithm
    for check in algorithm.all_checks:
      check(config)
    self.config = config
    self.mesh = mesh
    self.rules = sharding.as_rules(config.sharding.logical_axis_rules)
    # Where files beside the checkpoints go (precomputed reference
    # log-probs); None for a trainer that only scores or samples.
    self.workdir = workdir
    self.shapes_only = shapes_only
    if config.data.task_modules:
      from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
      pipeline.import_task_modules(config.data.task_modules)
    self.vocabulary = planned_vocabulary(config) if shapes_only else None
    if self.vocabulary is None:
      # The data stack (seqio, TensorFlow) loads here, where a run first
      # reads its task, not with the config; a plan only where the task's
      # registration alone knows its vocabulary.
      # pylint: disable=g-import-not-at-top
      from jaxrlhf.data import file_tasks
      from jaxrlhf.data import pipeline
      # pylint: enable=g-import-not-at-top
      if config.data.files.train:
        file_tasks.register_task_from_files(config, files_kind(algorithm))
      features = pipeline.get_task(config.data.task).output_features
      feature = (features.get("targets") or features.get("prompt")
                 or next(iter(features.values())))
      self.vocabulary = feature.vocabulary
    # The platform of the run's devices (a plan's TPU chips on a CPU host).
    self.platform = mesh.devices.flat[0].platform
    self.model, self.model_config = build_model(config.model,
                                                self.vocabulary.vocab_size,
                                                self.platform)
    self.lm = scoring.adapter_for(self.model)
    # Prompts of data.inputs_length tokens as the model reads them, with the
    # EOS the task appends (`models.prompt_feature_length`).
    self.prompt_length = prompt_feature_length(config.model,
                                               config.data.inputs_length)
    self.architecture = ("encoder_decoder" if self.lm.is_encoder_decoder
                         else "decoder_only")
    self.feature_lengths = (algorithm.feature_lengths(self)
                            if algorithm.feature_lengths
                            else self._default_feature_lengths())
    # A plan lays batches out from the feature lengths (`batch_spec`), with
    # no converter (seqio).
    self.feature_converter = (None if shapes_only
                              else algorithm.feature_converter(self)
                              if algorithm.feature_converter
                              else self._default_feature_converter())
    # Set by the algorithm's Training where it applies.
    self.online = None
    self.precomputed_reference = None
    algorithm.training.setup(self)
    self.lora = lora_state.setup(self)
    # evaluate=False: a trainer that never judges its policy (`evaluate`
    # returns {}), e.g. stepped from a notebook on batches of its own.
    self._evaluates = evaluate
    if algorithm.evaluation.check and evaluate and not shapes_only:
      algorithm.evaluation.check(self)
    self.tx = self._make_optimizer()
    algorithm.training.check_rows(
        algorithm, config, sharding.data_parallel_size(mesh, self.rules))
    self._init, self.state_shardings, self.abstract_state = (
        state_lib.make_sharded_init(self._init_networks, self.tx, mesh,
                                    self.rules,
                                    algorithm.carried.init(config)))
    # The running sum of micro-batch gradients, split over the data shards.
    self.accumulator_shardings = sharding.spread_over_batch_axes(
        self.abstract_state.params, self.state_shardings.params, mesh,
        self.rules)
    self.train_step = algorithm.training.train_step_function(self)

  # --- data --------------------------------------------------------------------

  def _default_feature_lengths(self) -> Dict[str, int]:
    data = self.config.data
    if self.algorithm.data in (base.SFT_DATA, base.PROMPTS):
      return {"inputs": self.prompt_length, "targets": data.targets_length}
    kind = alignment_kinds.get_kind(self.algorithm.data)
    lengths = {"prompt": self.prompt_length}
    for field in kind.completion_fields:
      lengths[field] = data.targets_length
    return lengths

  def converter_options(self) -> Dict[str, Any]:
    """Keyword arguments of the decoder-only feature converters."""
    return ({} if self.lm.is_encoder_decoder
            else {"eos_id": self.vocabulary.eos_id})

  def _default_feature_converter(self):
    # pylint: disable=g-import-not-at-top
    import seqio
    from jaxrlhf.data import alignment_data
    from jaxrlhf.data import feature_converters
    # pylint: enable=g-import-not-at-top
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
    return self.algorithm.training.batches(self, position)

  def batch_spec(self) -> Dict[str, jax.ShapeDtypeStruct]:
    """The global shape and dtype of each feature of a training batch, from
    the config alone (no data is read): what `train_step` is compiled for."""
    return self.algorithm.training.batch_spec(self)

  def tokens_in(self, local_batch) -> int:
    """Tokens a train step learns from, over all processes (tokens/s):
    completion tokens offline, sampled tokens online."""
    return self.algorithm.training.tokens_in(self, local_batch)

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
    trainable, frozen = networks.trainable(self, a), networks.frozen(self, b)
    if self.lora is not None:
      trainable, frozen = self.lora.adapt(trainable, frozen,
                                          jax.random.fold_in(rng, 1))
    return trainable, frozen

  def init_state(self):
    """A new run's train state: the checkpoints its networks start from
    (`Networks.checkpoints`, and what an online algorithm reads from the
    reward model), then a random initialisation of the networks no
    checkpoint fills (the others are never initialised)."""
    abstract = state_lib.abstract_with_shardings(self.abstract_state,
                                                 self.state_shardings)
    loaded = {}
    checkpoints = self.algorithm.networks.checkpoints(self)
    if self.lora is not None:
      checkpoints = self.lora.checkpoint_targets(checkpoints)
    for target, path in checkpoints.items():
      if not path:
        continue
      try:
        self._check_checkpoint_vocabulary(target, path)
        loaded[target] = pretrained.load_lm_params(
            path, state_lib.subtree(abstract, target), **self.hf_options())
      except ValueError as e:
        raise ValueError(f"{self._config_field_of(path)}: {e}") from None
    loaded.update(self.algorithm.training.loaded_networks(self, abstract))
    state = self._init(jax.random.PRNGKey(self.config.seed), loaded)
    self.algorithm.training.after_init(self, state)
    return state

  def initial_policy_params(self):
    """The policy as a new run starts it, loaded afresh (the reference of a
    run that keeps none in its state)."""
    if self.lora is not None:
      return self.lora.load_base()
    path = self.algorithm.networks.checkpoints(self).get("params/policy")
    if not path:
      return self._init(jax.random.PRNGKey(self.config.seed)).params["policy"]
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        self.abstract_state.params["policy"],
        self.state_shardings.params["policy"])
    return pretrained.load_lm_params(path, target, **self.hf_options())

  def hf_options(self):
    """What a Hugging Face checkpoint needs to load into this run: the model,
    and the ids the vocabulary exchanges (`hf_tokenizer`)."""
    return {"module": self.model,
            "token_swap": getattr(self.vocabulary, "token_swap", None)}

  def reference_params(self, state):
    """The policy the run started from, which evaluation compares with: the
    frozen reference in the state, or loaded afresh when the run keeps none
    there (precomputed reference log-probs, reference-free losses) or its
    step changes it (TR-DPO)."""
    state = self.view(state)
    if ("reference" in state.frozen
        and "reference" not in self.algorithm.carried.changes_frozen):
      return state.frozen["reference"]
    return self.initial_policy_params()

  # --- LoRA: the state the algorithms read, and what checkpoints hold -----------

  def view(self, state):
    """The state as the algorithms read it: itself, or, in a LoRA run, with
    each adapted network the base plus its adapters and the base as
    `frozen["reference"]` (`lora_state`). A view's view is itself."""
    return state if self.lora is None else self.lora.view(state)

  def view_parts(self, params, frozen, dropout_rng=None):
    """(params, frozen) as the algorithms read them (`view`); in a LoRA run
    with `dropout_rng`, the adapters' dropout is on (training)."""
    if self.lora is None:
      return params, frozen
    return self.lora.view_parts(params, frozen, dropout_rng)

  def checkpointed(self, state):
    """What a checkpoint holds of `state`: all of it, or, in a LoRA run,
    everything but the frozen base (which `with_base` loads again)."""
    return state if self.lora is None else self.lora.checkpointed(state)

  def checkpoint_target(self):
    """The abstract (sharded) state a checkpoint restores into."""
    abstract = state_lib.abstract_with_shardings(self.abstract_state,
                                                 self.state_shardings)
    return self.checkpointed(abstract)

  def base_record(self, state):
    """What names a LoRA run's base (`LoraRun.record`), or None."""
    return None if self.lora is None else self.lora.record(state)

  def with_base(self, state, record):
    """A restored checkpoint's state made whole: in a LoRA run, the base
    loaded again and checked against its `record`."""
    return state if self.lora is None else self.lora.with_base(state,
                                                               record)

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
    from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
    run = pretrained.run_config(path)
    trained = tasks.run_vocabulary(run) if run else None
    if trained is not None:
      vocab.require_same(
          trained, self.vocabulary, f"The checkpoint {path!r} (loaded into "
          f"{target})", f"this run's data (config.data.task "
          f"{self.config.data.task!r})", "Use data with the checkpoint's "
          "vocabulary (config.data.files.vocabulary for files) or a "
          "checkpoint trained on this one.")

  # --- optimisation ------------------------------------------------------------

  def _make_optimizer(self):
    networks = self.algorithm.networks
    per_network = (networks.optimizers(self.config) if networks.optimizers
                   else None)
    scales = (networks.update_scales(self.config) if networks.update_scales
              else None)
    self._policy_update_scale = (scales or {}).get("policy", 1.0)
    return self.algorithm.training.optimizer(self, per_network, scales)

  def learning_rate(self, step):
    """The policy's learning rate at train step `step`, times the factor its
    updates are scaled by (`Networks.update_scales`: DRO-V's 1/tau)."""
    rate = self.algorithm.training.learning_rate(self, step)
    if self._policy_update_scale == 1:
      return rate
    return rate * self._policy_update_scale

  # --- the end and evaluation ---------------------------------------------------

  def finish_training(self, state) -> Tuple[Any, Dict[str, float]]:
    """(the state the final checkpoint holds, metrics logged with the last
    step); the loop calls it once, after the last train step."""
    if self.algorithm.finish is None:
      return state, {}
    return self.algorithm.finish(self, state)

  def evaluate(self, state) -> Dict[str, float]:
    """Evaluation metrics ("eval/..." keys); {} for a trainer built with
    evaluate=False."""
    if not self._evaluates:
      return {}
    return self.algorithm.evaluation.evaluate(self, self.view(state))

  def evaluation_description(self) -> str:
    """What `evaluate` measures on, for the console lines."""
    if not self._evaluates:
      return "no evaluation"
    return self.algorithm.evaluation.describe(self.config)


def planned_vocabulary(config) -> Optional[vocab.SizeOnlyVocabulary]:
  """The vocabulary a shapes-only trainer lays its model out with, from the
  config alone: a vocabulary file's at config.model.vocab_size or its
  preset's (the file may be anywhere, gs:// included, and is not read), a
  file task's default (the synthetic task's) or a built-in task's at its
  word model's size (`data.shapes`); None where only the task's seqio
  registration knows it (another registered task, or one of
  config.data.task_modules)."""
  files = config.data.files
  if files.vocabulary:
    return vocab.SizeOnlyVocabulary(planned_vocab_size(config.model))
  if files.train:
    return vocab.SizeOnlyVocabulary(shapes.files_vocab_size())
  if config.data.task_modules:
    return None
  size = shapes.builtin_vocab_size(config.data.task)
  return None if size is None else vocab.SizeOnlyVocabulary(size)


def files_kind(algorithm: base.Algorithm) -> str:
  """What config.data.files hold for `algorithm`: its alignment kind,
  demonstrations (prompt and reference completion) for SFT, or the prompts
  of online RL (the same rows; a completion is not needed)."""
  if algorithm.data == base.SFT_DATA:
    return alignment_kinds.DEMONSTRATIONS.name
  if algorithm.data == base.PROMPTS:
    return alignment_kinds.PROMPTS.name
  return algorithm.data

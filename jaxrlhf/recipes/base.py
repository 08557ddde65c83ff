"""What every recipe shares: model, data, sharded state, jitted step.

A recipe is an algorithm: which networks it trains (`init_trainable`), which
it keeps frozen (`init_frozen`, e.g. the reference policy), what data it
reads (`data_kind`), its loss (`loss`), and its evaluation. This base class
does the rest, so adding an algorithm touches one module under
`jaxrlhf/recipes/` and one line of the registry.

The train state holds the trainable networks (`params`, a dict by network
name), their optimizer states, the frozen networks (`frozen`), the step and
the RNG; all of it is checkpointed.
"""

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import seqio
import tensorflow as tf

from jaxrlhf import sharding
from jaxrlhf.data import alignment_data
from jaxrlhf.data import file_sources
from jaxrlhf.data import pipeline
from jaxrlhf.data import tasks
from jaxrlhf.data import vocab
from jaxrlhf.models import build_model
from jaxrlhf.models import scoring
from jaxrlhf.train import optimizers
from jaxrlhf.train import pretrained
from jaxrlhf.train import state as state_lib
from jaxrlhf.train import steps


class Recipe:
  """Base class; subclasses define the hooks marked "hook"."""

  # hook: the alignment data kind ("pairs", "trajectory", ...); None = SFT.
  data_kind: Optional[str] = None
  # The run's workdir, for recipes that keep files beside the checkpoints
  # (precomputed reference log-probs); the training loop sets it.
  workdir: Optional[str] = None

  def __init__(self, config, mesh):
    self.config = config
    self.mesh = mesh
    self.rules = sharding.as_rules(config.sharding.logical_axis_rules)
    pipeline.import_task_modules(config.data.task_modules)
    if config.data.files.train:
      register_task_from_files(config, self.data_kind)
    task = pipeline.get_task(config.data.task)
    features = task.output_features
    feature = (features.get("targets") or features.get("prompt")
               or next(iter(features.values())))
    self.vocabulary = feature.vocabulary
    self.model, self.model_config = build_model(config.model,
                                                self.vocabulary.vocab_size)
    self.lm = scoring.adapter_for(self.model)
    self.architecture = ("encoder_decoder" if self.lm.is_encoder_decoder
                         else "decoder_only")
    self.feature_lengths = self.make_feature_lengths()
    self.feature_converter = self.make_feature_converter()
    self.tx = self.make_optimizer()
    self._check_batch_size()
    self._init, self.state_shardings, self.abstract_state = (
        state_lib.make_sharded_init(self._init_trainable_and_frozen, self.tx,
                                    mesh, self.rules))
    batch_sharding = sharding.batch_sharding(self.mesh, self.rules, 1)
    self.train_step = jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, batch_sharding),
        out_shardings=(self.state_shardings, sharding.replicated(mesh)),
        donate_argnums=0)

  # --- data ------------------------------------------------------------------

  def make_feature_lengths(self) -> Dict[str, int]:
    """hook: task feature lengths. Default: prompt + each completion field."""
    kind = alignment_data.get_kind(self.data_kind)
    lengths = {"prompt": self.config.data.inputs_length}
    for field in kind.completion_fields:
      lengths[field] = self.config.data.targets_length
    return lengths

  def make_feature_converter(self):
    kwargs = ({} if self.lm.is_encoder_decoder
              else {"eos_id": self.vocabulary.eos_id})
    return alignment_data.feature_converter_for(self.data_kind,
                                                self.architecture, **kwargs)

  def train_batches(self, position: int):
    return pipeline.BatchIterator(
        self.config.data.task, self.config.data.train_split,
        self.feature_lengths, self.feature_converter,
        self.config.train.batch_size, seed=self.config.seed, shuffle=True,
        position=position)

  def tokens_in(self, local_batch) -> int:
    """Completion tokens in a global batch (for tokens/s)."""
    n = sum(int(np.sum(v)) for k, v in local_batch.items()
            if k.endswith("loss_weights"))
    return n * jax.process_count()

  def _check_batch_size(self):
    dp = sharding.data_parallel_size(self.mesh, self.rules)
    per_micro = self.config.train.batch_size // self.config.train.num_microbatches
    if per_micro % dp:
      raise ValueError(
          f"config.train.batch_size: {self.config.train.batch_size} / "
          f"{self.config.train.num_microbatches} micro-batches = {per_micro} "
          f"rows cannot be split over {dp} data-parallel shards.")

  # --- networks ----------------------------------------------------------------

  def init_lm(self, rng):
    """Fresh (boxed) parameters of the configured language model."""
    if self.lm.is_encoder_decoder:
      enc = jnp.ones((1, self.config.data.inputs_length), jnp.int32)
      dec = jnp.ones((1, self.config.data.targets_length), jnp.int32)
      return self.model.init(rng, enc, dec, dec)["params"]
    length = self.config.data.inputs_length + self.config.data.targets_length
    tokens = jnp.ones((1, length), jnp.int32)
    return self.model.init(rng, tokens, jnp.arange(length)[None],
                           tokens)["params"]

  def init_trainable(self, rng) -> Dict:
    """hook: {network name: boxed params} of the networks the step trains."""
    raise NotImplementedError

  def init_frozen(self, rng) -> Dict:
    """hook: {network name: boxed params} of networks held fixed."""
    del rng
    return {}

  def _init_trainable_and_frozen(self, rng):
    a, b = jax.random.split(rng)
    return self.init_trainable(a), self.init_frozen(b)

  def pretrained_paths(self) -> Dict[str, str]:
    """hook: {"params/<net>" or "frozen/<net>": checkpoint path} to load
    over the fresh initialisation of a new run."""
    return {}

  def init_state(self):
    state = self._init(jax.random.PRNGKey(self.config.seed))
    for target, path in self.pretrained_paths().items():
      if not path:
        continue
      group, name, *sub = target.split("/")
      tree = getattr(state, group)
      node = tree[name]
      for key in sub:
        node = node[key]
      try:
        self._check_checkpoint_vocabulary(target, path)
        loaded = pretrained.load_lm_params(path, node)
      except ValueError as e:
        raise ValueError(f"{self._config_field_of(path)}: {e}") from None
      tree = _replace_subtree(tree, [name] + sub, loaded)
      state = state.replace(**{group: tree})
    return state

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

  # --- optimisation --------------------------------------------------------------

  def optimizer_configs(self) -> Dict[str, object]:
    """hook: {network name: optimizer ConfigDict}; default: one for all."""
    return {}

  def make_optimizer(self):
    per_network = self.optimizer_configs()
    steps_total = self.config.train.num_steps
    if not per_network:
      return optimizers.make_optimizer(self.config.optimizer, steps_total)
    transforms = {name: optimizers.make_optimizer(cfg, steps_total)
                  for name, cfg in per_network.items()}
    # Labels: each top-level network uses its own optimizer.
    return optax.multi_transform(transforms, {k: k for k in transforms})

  def loss(self, params, frozen, batch, rng):
    """hook: (scalar loss, {metric: scalar}) for one (micro-)batch; the loss
    is a mean over the batch's examples."""
    raise NotImplementedError

  def _train_step(self, state, batch):
    rng, step_rng = jax.random.split(state.rng)
    micro = self.config.train.num_microbatches

    def loss_fn(params, mb, mb_rng):
      loss, metrics = self.loss(params, state.frozen, mb, mb_rng)
      return loss / micro, jax.tree.map(lambda m: m / micro, metrics)

    loss, metrics, grads = steps.accumulate_gradients(
        loss_fn, state.params, batch, step_rng, micro)
    params, opt_state, out = steps.guarded_update(
        state, grads, loss, self.tx,
        dict(metrics, learning_rate=optimizers.learning_rate_schedule(
            self.config.optimizer, self.config.train.num_steps)(state.step)))
    return state.replace(step=state.step + 1, params=params,
                         opt_state=opt_state, rng=rng), out

  def finish_training(self, state) -> Tuple[Any, Dict[str, float]]:
    """hook: (the state the final checkpoint holds, metrics logged with the
    last step); the loop calls it once, after the last train step."""
    return state, {}

  def evaluate(self, state) -> Dict[str, float]:
    """hook: evaluation metrics ("eval/..." keys)."""
    del state
    return {}

  def evaluation_description(self) -> str:
    """hook: what `evaluate` measures on, for the console lines."""
    return f"{self.config.eval.num_examples} held-out examples"


def parse_column_mapping(text: str) -> Optional[Dict[str, str]]:
  """"prompt=question,reward=score" -> {"prompt": "question", ...}."""
  if not text:
    return None
  mapping = {}
  for item in text.split(","):
    field, sep, column = item.partition("=")
    if not sep or not field.strip() or not column.strip():
      raise ValueError(f"config.data.files.column_mapping: {item!r} is not "
                       "field=column.")
    mapping[field.strip()] = column.strip()
  return mapping


def register_task_from_files(config, kind: Optional[str]) -> None:
  """Registers config.data.task from config.data.files (see defaults.py)."""
  files = config.data.files
  if kind is None:
    raise ValueError(
        f"config.data.files: {config.algorithm} reads a registered seqio "
        "task (config.data.task); file sources are for the offline "
        "alignment data kinds (pairs, rankings, trajectories, thumbs).")
  name = config.data.task
  if name in seqio.MixtureRegistry.names() or (
      name in seqio.TaskRegistry.names() and not isinstance(
          seqio.get_mixture_or_task(name).source,
          file_sources.AlignmentFileSource)):
    raise ValueError(
        f"config.data.task: {name!r} is already a registered seqio task, and "
        "config.data.files.train registers the files as a task under that "
        "name. Give your data its own name, e.g. --config.data.task=my_prefs "
        "(files registered by an earlier run of this process are replaced).")
  for field in ("train", "validation", "vocabulary"):
    pattern = files[field]
    if pattern and not tf.io.gfile.glob(pattern):
      raise ValueError(f"config.data.files.{field}: no file matches "
                       f"{pattern!r}.")
  if files.vocabulary:
    vocabulary = seqio.SentencePieceVocabulary(files.vocabulary)
  else:
    vocabulary = tasks.synthetic_vocabulary()
  paths = {"train": files.train}
  if files.validation:
    paths["validation"] = files.validation
  alignment_data.register_file_task(
      config.data.task, paths, kind=kind, vocabulary=vocabulary,
      layout=files.layout, column_mapping=parse_column_mapping(
          files.column_mapping),
      max_prompt_tokens=config.data.inputs_length,
      # Both lengths count the EOS the task appends.
      max_completion_tokens=(files.max_completion_tokens
                             or config.data.targets_length),
      normalize_rewards=files.normalize_rewards and kind == "trajectory",
      on_bad_row=files.on_bad_row, seed=config.seed, overwrite=True)


def _replace_subtree(tree, path, value):
  if not path:
    return value
  out = dict(tree)
  out[path[0]] = _replace_subtree(tree[path[0]], path[1:], value)
  return out

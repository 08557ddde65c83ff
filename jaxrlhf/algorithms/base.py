"""What an algorithm is: data and functions, composed, not subclassed.

An `Algorithm` says which data it reads, which networks it trains and
freezes (`Networks`), how it learns (its `Training`:
`offline.training.Offline`, a pure loss over a batch, or
`online.recipe.Online`, rollout -> targets -> updates), what it carries
from step to step (`Carried`), how it is judged
(`Evaluation`), and which config groups it owns. It is registered once, in
`jaxrlhf/algorithms/__init__.py`; the config's allowed values, the
pipeline's stages and the reference docs all derive from that registry.

Every function of an algorithm takes the `Trainer` (`trainer.py`) first: the
run's shared parts (config, mesh, model and its scoring adapter,
vocabulary, feature layout) that the algorithm reads but does not build.
"""

import dataclasses
import functools
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import jax

from jaxrlhf import config_schema
from jaxrlhf import sharding
from jaxrlhf.algorithms import lora_state

# The data an algorithm reads: "sft" (a seqio task's inputs/targets), one of
# the alignment kinds of `jaxrlhf.data.alignment_kinds` ("pairs", "ranking",
# "trajectory", "thumbs"), or "prompts" (online: the task's prompts only).
SFT_DATA = "sft"
PROMPTS = "prompts"

Params = Any
Metrics = Dict[str, Any]


def _no_networks(trainer, rng) -> Dict[str, Any]:
  del trainer, rng
  return {}


def _no_checkpoints(trainer) -> Dict[str, str]:
  del trainer
  return {}


@dataclasses.dataclass(frozen=True)
class Networks:
  """The networks of a run.

  Attributes:
    trainable: (trainer, rng) -> {name: boxed params} of the networks the
      step trains ("policy", "value", "reward").
    frozen: (trainer, rng) -> {name: boxed params} it only reads
      ("reference", "reward").
    checkpoints: (trainer) -> {"params/<net>[/sub]" or "frozen/<net>":
      checkpoint path} loaded over a new run's initialisation.
    optimizers: (config) -> {network: optimizer ConfigDict}, one optimizer
      per network; None = `config.optimizer` for everything.
    update_scales: (config) -> {network: factor} multiplying that
      network's updates after its optimizer (DRO-V's policy learning-rate
      rescaling); an offline algorithm needs `optimizers` for it. None =
      every factor 1.
    reference: the run holds (or can load) a frozen copy of the starting
      policy that evaluation compares the policy with.
    fresh_backbone: (config) -> "" when every trained backbone starts from
      the policy's checkpoint, else how to make it so (LoRA adapts the
      policy's base, so a freshly initialised backbone has none to adapt:
      DRO-V's value network with dro.value_from_policy=False).
  """
  trainable: Callable[[Any, Any], Dict[str, Params]]
  frozen: Callable[[Any, Any], Dict[str, Params]] = _no_networks
  checkpoints: Callable[[Any], Dict[str, str]] = _no_checkpoints
  optimizers: Optional[Callable[[Any], Mapping[str, Any]]] = None
  update_scales: Optional[Callable[[Any], Mapping[str, float]]] = None
  reference: bool = False
  fresh_backbone: Callable[[Any], str] = lambda config: ""


@dataclasses.dataclass(frozen=True)
class Carried:
  """What an algorithm carries from one train step to the next besides its
  trained networks and their optimizer states.

  `TrainState.algorithm_state` holds named values (scalars or arrays) that
  `init` gives from the config: an adaptive KL coefficient, REINFORCE's
  running baseline, BCO's running reward mean. A step may also change
  frozen networks (`changes_frozen`: TR-DPO mixes the policy into its
  reference). Both are checkpointed with the rest of the state, so a
  resumed run carries on exactly; how a step updates them is its
  `Training`'s business (`training.Offline.carry`, an online algorithm's
  targets).

  Attributes:
    init: (config) -> {name: initial value}.
    changes_frozen: frozen networks the step updates; evaluation then
      compares with the policy the run started from, loaded afresh, not
      with the changed network.
    checks: cross-field checks of the settings that give these values,
      run with the algorithm's own (`Algorithm.all_checks`).
  """
  init: Callable[[Any], Dict[str, Any]] = lambda config: {}
  changes_frozen: Tuple[str, ...] = ()
  checks: Tuple[config_schema.Check, ...] = ()


# Most algorithms carry nothing.
NOTHING_CARRIED = Carried()


class Training:
  """How an algorithm learns: what each train step reads and does.

  `offline.training.Offline` (one gradient update per batch of a dataset)
  and `online.recipe.Online` (rollout -> targets -> updates on the
  policy's own samples) implement it; the trainer calls
  these and never asks which one it has. Every method takes the
  `Trainer` first.
  """
  # Whether a step samples from the policy (the online stages of the
  # pipeline; the docs' table).
  online = False

  def setup(self, trainer) -> None:
    """Resolves run settings onto the trainer, once, when it is built."""

  def check_rows(self, algorithm, config, data_parallel: int) -> None:
    """Refuses batch splits that cannot work, from the config alone."""
    raise NotImplementedError

  def whole_batch_statistic(self, config) -> Optional[str]:
    """What the loss estimates from the whole batch (so that micro-batches
    would change it), or None."""
    del config
    return None

  def batches(self, trainer, position: int):
    """This process's share of consecutive training batches from batch
    `position` on (an iterator with a `position` attribute)."""
    raise NotImplementedError

  def batch_spec(self, trainer) -> Dict[str, Any]:
    """{feature: jax.ShapeDtypeStruct} of a global training batch."""
    raise NotImplementedError

  def tokens_in(self, trainer, local_batch) -> int:
    """Tokens this process's batch trains on (for tokens/s)."""
    raise NotImplementedError

  def loaded_networks(self, trainer, abstract_state) -> Dict[str, Any]:
    """{target: loaded tree} a new run starts from besides
    `Networks.checkpoints` (the reward model of online RL)."""
    del trainer, abstract_state
    return {}

  def after_init(self, trainer, state) -> None:
    """Work a new run does once its state exists (precomputing the
    reference's log-probs)."""
    del trainer, state

  def optimizer(self, trainer, per_network, update_scales):
    """The optax transformation of every trained network."""
    raise NotImplementedError

  def learning_rate(self, trainer, step):
    """The policy's learning rate at train step `step` (before
    `Networks.update_scales`)."""
    raise NotImplementedError

  def step(self, trainer, state, batch):
    """One train step as a function to compile: (state, metrics)."""
    raise NotImplementedError

  def train_step_function(self, trainer):
    """What the loop calls each step, (state, batch) -> (state, metrics):
    `step` compiled once, the batch split over the data shards and the
    state donated (its buffers reused)."""
    return jax.jit(
        functools.partial(self.step, trainer),
        in_shardings=(trainer.state_shardings,
                      sharding.batch_sharding(trainer.mesh, trainer.rules, 1)),
        out_shardings=(trainer.state_shardings,
                       sharding.replicated(trainer.mesh)),
        donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """How a run is judged before, during and after training.

  Attributes:
    evaluate: (trainer, state) -> {"eval/...": value}, or {} when there is
      nothing to judge with.
    describe: (config) -> what the numbers are measured on, for the
      console ("256 held-out prompts x 2 samples at temperature 1").
    check: (trainer) -> None, run when the trainer is built: refuses an
      evaluation that cannot work, before anything is written.
  """
  evaluate: Callable[[Any, Any], Dict[str, float]]
  describe: Callable[[Any], str]
  check: Optional[Callable[[Any], None]] = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One algorithm, as the registry holds it.

  Attributes:
    name: its `config.algorithm` value.
    summary: one line for the docs.
    data: what it reads (SFT_DATA, an alignment kind, or PROMPTS).
    networks: its `Networks`.
    training: its `Training` (`training.Offline` or `recipe.Online`).
    carried: what it carries between steps (`Carried`).
    evaluation: its `Evaluation`.
    config_groups: the config groups it reads besides the shared ones
      (several algorithms may share one, e.g. "online").
    checks: cross-field checks that apply when it is the selected
      algorithm: (config) -> None or ValueError("config.<field>: ...").
    feature_lengths: (trainer) -> task feature lengths, when not the data
      kind's default (prompt + completions at data.inputs_length /
      data.targets_length).
    feature_converter: (trainer) -> seqio feature converter, when not the
      data kind's default for the model's architecture.
    finish: (trainer, state) -> (state, metrics) after the last step,
      before the final save (reward normalisation).
    pipeline_stage: runs as a stage of `jaxrlhf.offline_pipeline`, the
      quickstart's pipeline (SFT, the reward model, offline policies on
      pairs or trajectories, online); off unless an algorithm asks, so a
      new algorithm does not change the quickstart's stages.
  """
  name: str
  summary: str
  data: str
  networks: Networks
  training: Training
  evaluation: Evaluation
  carried: Carried = NOTHING_CARRIED
  config_groups: Sequence[config_schema.Group] = ()
  checks: Sequence[config_schema.Check] = ()
  feature_lengths: Optional[Callable[[Any], Dict[str, int]]] = None
  feature_converter: Optional[Callable[[Any], Any]] = None
  finish: Optional[Callable[[Any, Any], Tuple[Any, Metrics]]] = None
  pipeline_stage: bool = False

  @property
  def online(self) -> bool:
    return self.training.online

  @property
  def all_checks(self) -> Tuple[config_schema.Check, ...]:
    """What LoRA and precomputed reference log-probs cannot serve of it
    (the shared groups' checks, first), its own checks and those of what
    it carries."""
    return (functools.partial(lora_state.check_lora, algorithm=self),
            functools.partial(check_reference_mode, algorithm=self),
            *self.checks, *self.carried.checks)


def check_reference_mode(c, algorithm: "Algorithm") -> None:
  """'precomputed' only for losses that read the reference per example
  (one of `Algorithm.all_checks`)."""
  config_schema.require(
      c.reference_logprobs.mode == "in_step" or precomputable(algorithm),
      "reference_logprobs.mode",
      f"'precomputed' does not apply to {c.algorithm!r}, whose reference "
      "log-probs depend on more than each example's own completion (KTO's "
      "KL baseline scores mismatched pairs that change with the batch; "
      "online algorithms score fresh samples; TR-DPO moves its reference; "
      "reference-free losses have none); use 'in_step'.")


def precomputable(algorithm: "Algorithm") -> bool:
  """The algorithm's loss reads the reference only per example, so its
  log-probs may be precomputed once."""
  return bool(getattr(algorithm.training, "precomputable_reference", False))

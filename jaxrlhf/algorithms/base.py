"""What an algorithm is: data and functions, composed, not subclassed.

An `Algorithm` says which data it reads, which networks it trains and
freezes (`Networks`), how it learns (`Offline`: a pure loss over a batch;
or `Online`: rollout -> targets -> updates), how it is judged
(`Evaluation`), and which config groups it owns. It is registered once, in
`jaxrlhf/algorithms/__init__.py`; the config's allowed values, the
pipeline's stages and the reference docs all derive from that registry.

Every function of an algorithm takes the `Trainer` (`trainer.py`) first: the
run's shared parts (config, mesh, model and its scoring adapter,
vocabulary, feature layout) that the algorithm reads but does not build.
"""

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from jaxrlhf import config_schema

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
    optimizers: (trainer) -> {network: optimizer ConfigDict}, one optimizer
      per network; None = `config.optimizer` for everything.
    update_scales: (trainer) -> {network: factor} multiplying that
      network's updates after its optimizer (DRO-V's policy learning-rate
      rescaling); an offline algorithm needs `optimizers` for it. None =
      every factor 1.
    reference: the run holds (or can load) a frozen copy of the starting
      policy that evaluation compares the policy with.
  """
  trainable: Callable[[Any, Any], Dict[str, Params]]
  frozen: Callable[[Any, Any], Dict[str, Params]] = _no_networks
  checkpoints: Callable[[Any], Dict[str, str]] = _no_checkpoints
  optimizers: Optional[Callable[[Any], Mapping[str, Any]]] = None
  update_scales: Optional[Callable[[Any], Mapping[str, float]]] = None
  reference: bool = False


@dataclasses.dataclass(frozen=True)
class Offline:
  """Learning from a dataset: one gradient update per batch.

  Attributes:
    loss: (trainer, params, frozen, batch, rng) -> (loss, metrics), a pure
      function: the loss is a mean over the batch's examples (for the
      micro-batches to add up, see `update.mean_over_examples`).
    share: optional (trainer, loss_fn, batch) -> loss_fn returning each
      micro-batch's share of the batch loss, for a loss that is not a mean
      over examples (SFT's mean over target tokens).
    precomputable_reference: the loss reads the reference only as
      log pi_ref(completion | prompt) of each example's own completions,
      so `reference_logprobs.mode = "precomputed"` may compute them once.
    batch_statistics: optional (config) -> what the loss estimates from the
      whole batch (KTO's KL baseline), or None: micro-batches would
      estimate it from each micro-batch and change the loss, so
      `train.num_microbatches` > 1 is refused naming it.
  """
  loss: Callable[..., Tuple[Any, Metrics]]
  share: Optional[Callable[..., Callable]] = None
  precomputable_reference: bool = False
  batch_statistics: Optional[Callable[[Any], Optional[str]]] = None


@dataclasses.dataclass(frozen=True)
class Online:
  """Learning from the policy's own samples: each train step is one
  iteration of rollout -> targets -> updates (`online.online_step`).

  Attributes:
    samples_per_prompt: responses per prompt when `online.samples_per_prompt`
      is unset (the group size of RLOO/GRPO).
    num_epochs: passes over each rollout when `online.num_epochs` is unset.
    targets: (trainer, state, rollout) -> (update rows {name: [rows, ...]},
      new algorithm state, metrics): what the updates train on (PPO's
      advantages and returns; a group's advantages; the selected samples).
    loss: (trainer, params, minibatch, algorithm_state) -> (loss, metrics)
      of one update; algorithm_state is the step's carried state before
      this step changes it (GRPO's in-loss KL coefficient).
    loss_count: (trainer, minibatch) -> what the loss is a mean over, for
      the micro-batches' shares (default: response tokens).
    algorithm_state: (config) -> {name: initial scalar} carried between
      steps.
    update_rows: (config, prompts per step) -> rows the updates use
      (default: every response).
    sample_params: (trainer, params, frozen) -> the parameters responses are
      sampled from (default: the policy).
    value_from_reward_model: trainable networks initialised from the reward
      model (PPO's value network, detail 22).
  """
  samples_per_prompt: int
  num_epochs: int
  targets: Callable[..., Tuple[Any, Any, Metrics]]
  loss: Callable[..., Tuple[Any, Metrics]]
  loss_count: Optional[Callable[..., Any]] = None
  algorithm_state: Optional[Callable[[Any], Dict[str, float]]] = None
  update_rows: Optional[Callable[[Any, int], int]] = None
  sample_params: Optional[Callable[..., Params]] = None
  value_from_reward_model: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """How a run is judged before, during and after training.

  Attributes:
    evaluate: (trainer, state) -> {"eval/...": value}, or {} when there is
      nothing to judge with.
    describe: (trainer) -> what the numbers are measured on, for the
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
    training: `Offline` or `Online`.
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
    pipeline_stage: runs as a stage of `jaxrlhf.offline_pipeline` (SFT, the
      reward model, offline policies on pairs or trajectories, online).
  """
  name: str
  summary: str
  data: str
  networks: Networks
  training: Any
  evaluation: Evaluation
  config_groups: Sequence[config_schema.Group] = ()
  checks: Sequence[config_schema.Check] = ()
  feature_lengths: Optional[Callable[[Any], Dict[str, int]]] = None
  feature_converter: Optional[Callable[[Any], Any]] = None
  finish: Optional[Callable[[Any, Any], Tuple[Any, Metrics]]] = None
  pipeline_stage: bool = True

  @property
  def online(self) -> bool:
    return isinstance(self.training, Online)

  def whole_batch_statistic(self, config) -> Optional[str]:
    """What the loss estimates from the whole batch under `config` (so that
    micro-batches would change it), or None."""
    statistics = None if self.online else self.training.batch_statistics
    return statistics(config) if statistics else None

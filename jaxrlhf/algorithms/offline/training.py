"""Learning from a dataset: one guarded gradient update per batch.

`Offline(loss=...)` is the `Training` of SFT, the reward models, the DPO
family, KTO, BCO and DRO-V: the batches are a seqio task's (its data kind's
feature converter lays them out), and a train step is one
`update.gradient_update` of the algorithm's pure loss, optionally followed
by an update of what the algorithm carries between steps (`carry`).
"""

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.algorithms import base
from jaxrlhf.algorithms import optimizers
from jaxrlhf.algorithms.offline import precomputed_reference
from jaxrlhf.algorithms import update
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import shapes
from jaxrlhf.models import scoring


@dataclasses.dataclass(frozen=True)
class Offline(base.Training):
  """Learning from a dataset: one gradient update per batch.

  Attributes:
    loss: (trainer, params, state, batch, rng) -> (loss, metrics), a pure
      function of the trained `params`: `state` is the train state before
      the step (its frozen networks, `algorithm_state` and step); the loss
      is a mean over the batch's examples (for the micro-batches to add up,
      see `update.mean_over_examples`).
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
    carry: optional (trainer, state before the step, state after its
      update, the step's metrics) -> the state after the step: how the
      algorithm's `Carried` values and frozen networks move (BCO's running
      reward mean, TR-DPO's reference); None leaves them as they are.
    packs: the loss reads packed batches (`config.data.pack`): it takes
      its per-example quantities from `jaxrlhf.models.scoring`
      (`sequence_logprobs`, `example_weights`, `example_values`, ...), so
      that on a packed batch it is the same weighted mean over the
      examples as on the unpacked batch of those examples.
  """
  loss: Callable[..., Tuple[Any, base.Metrics]]
  share: Optional[Callable[..., Callable]] = None
  precomputable_reference: bool = False
  batch_statistics: Optional[Callable[[Any], Optional[str]]] = None
  carry: Optional[Callable[..., Any]] = None
  packs: bool = False

  def setup(self, trainer) -> None:
    trainer.precomputed_reference = (
        precomputed_reference.PrecomputedReference(trainer)
        if trainer.config.reference_logprobs.mode == "precomputed" else None)

  def whole_batch_statistic(self, config) -> Optional[str]:
    return self.batch_statistics(config) if self.batch_statistics else None

  def check_rows(self, algorithm, config, data_parallel: int) -> None:
    batch = config.train.batch_size
    estimated = self.whole_batch_statistic(config)
    if estimated and config.train.num_microbatches > 1:
      raise ValueError(
          f"config.train.num_microbatches: {algorithm.name} estimates "
          f"{estimated} from the whole batch; micro-batches would estimate "
          "it from each micro-batch and change the loss. Keep it at 1 and fit "
          "memory with model.remat_policy or the fully sharded rules "
          "(jaxrlhf.sharding_rules.FULLY_SHARDED_RULES).")
    update.check_split(batch, config.train.num_microbatches, data_parallel,
                       what=f"train.batch_size {batch}",
                       field="train.batch_size")

  def batches(self, trainer, position: int):
    # The data stack loads here, where the data is read, not with the config.
    from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
    config = trainer.config
    batches = pipeline.BatchIterator(
        config.data.task, config.data.train_split, trainer.feature_lengths,
        trainer.feature_converter, config.train.batch_size, seed=config.seed,
        shuffle=True, position=position, pack=config.data.pack)
    if trainer.precomputed_reference:
      return trainer.precomputed_reference.with_logprobs(batches)
    return batches

  def batch_spec(self, trainer) -> Dict[str, jax.ShapeDtypeStruct]:
    config = trainer.config
    batch = config.train.batch_size
    kind = (None if trainer.algorithm.data == base.SFT_DATA
            else trainer.algorithm.data)
    if trainer.feature_converter is None:
      # A shapes-only trainer (a plan): the layout of the kind's converter,
      # from the feature lengths alone (no TensorFlow or seqio).
      ranked = kind is not None and alignment_kinds.get_kind(kind).ranked
      example = shapes.example_spec(
          kind, trainer.architecture, trainer.feature_lengths,
          num_completions=(config.reward_model.num_completions if ranked
                           else None),
          **trainer.converter_options())
      if config.data.pack:
        example = shapes.packed_spec(example, config.data.pack)
    else:
      # The converter's own layout: its feature converters (seqio) load
      # with a trainer that reads data, not with the config.
      from jaxrlhf.data import feature_converters  # pylint: disable=g-import-not-at-top
      converted = feature_converters.output_spec(
          trainer.feature_converter, kind, trainer.feature_lengths)
      if config.data.pack:
        converted = feature_converters.Packer(converted,
                                              config.data.pack).output_spec()
      example = {name: (tuple(s.shape), s.dtype.as_numpy_dtype)
                 for name, s in converted.items()}
    spec = {name: jax.ShapeDtypeStruct((batch,) + shape, dtype)
            for name, (shape, dtype) in example.items()}
    if trainer.precomputed_reference:
      spec.update(trainer.precomputed_reference.spec(batch))
    return spec

  def tokens_in(self, trainer, local_batch) -> int:
    """Completion tokens (the loss weights), over all processes."""
    del trainer
    n = sum(int(np.sum(v)) for k, v in local_batch.items()
            if k.endswith("loss_weights"))
    return n * jax.process_count()

  def after_init(self, trainer, state) -> None:
    if trainer.precomputed_reference:
      # A new run's policy is the reference: score with it rather than
      # load the checkpoint a second time.
      trainer.precomputed_reference.prepare(
          lambda: trainer.view(state).params["policy"], new_run=True)

  def optimizer(self, trainer, per_network, update_scales):
    steps_total = trainer.config.train.num_steps
    if not per_network:
      if update_scales:
        raise ValueError(f"{trainer.algorithm.name}: Networks.update_scales "
                         "needs Networks.optimizers (one optimizer per "
                         "network).")
      return optimizers.make_optimizer(trainer.config.optimizer, steps_total)
    return optimizers.make_network_optimizers(per_network, steps_total,
                                              update_scales)

  def learning_rate(self, trainer, step):
    return optimizers.learning_rate_schedule(
        trainer.config.optimizer, trainer.config.train.num_steps)(step)

  def step(self, trainer, state, batch):
    rng, step_rng = jax.random.split(state.rng)
    micro = trainer.config.train.num_microbatches

    # What the loss reads: in a LoRA run, the base with the adapters
    # (`params` are the adapters alone) and the base as the reference.
    viewed = trainer.view(state)

    def loss_fn(params, microbatch, microbatch_rng):
      params, _ = trainer.view_parts(params, state.frozen, microbatch_rng)
      return self.loss(trainer, params, viewed, microbatch, microbatch_rng)

    if self.share is not None:
      share = self.share(trainer, loss_fn, batch)
    elif scoring.is_packed(batch):
      # Micro-batches of packed rows hold different numbers of examples.
      share = update.weighted_share(loss_fn, packed_examples, batch, micro)
    else:
      share = update.mean_over_examples(loss_fn, micro)
    params, opt_state, metrics = update.gradient_update(
        trainer.tx, state.params, state.opt_state, batch, step_rng, share,
        micro, trainer.accumulator_shardings)
    metrics["learning_rate"] = trainer.learning_rate(state.step)
    after = state.replace(step=state.step + 1, params=params,
                          opt_state=opt_state, rng=rng)
    if self.carry is not None:
      after = self.carry(trainer, state, after, metrics)
    return after, metrics


def packed_examples(batch):
  """The examples a packed (micro-)batch holds."""
  return jnp.sum(batch[scoring.EXAMPLE_MASK].astype(jnp.float32))

"""Reference log-probs computed once before training, fed with each batch.

With `config.reference_logprobs.mode = "precomputed"` (offline losses that
read the reference only as log pi_ref(completion | prompt) of each example's
own completions: `offline.Offline.precomputable_reference`) the reference
is not part of the train state. A run's `PrecomputedReference` (the
trainer's `precomputed_reference`) scores the training split with it once
into a cache (`reference_cache`: a table found by content, with a
fingerprint of what made it), and adds each example's `reference_logp_*`
features to the training batches; evaluation loads the reference from
`config.init.policy_checkpoint` only while it runs.
"""

import os
from typing import Callable, Dict

import jax
import numpy as np

from jaxrlhf import console
from jaxrlhf import sharding
from jaxrlhf.algorithms.offline import reference_cache
from jaxrlhf.data import alignment_kinds
from jaxrlhf.models import pretrained
from jaxrlhf.models import scoring


def checkpoint_fingerprint(path: str) -> Dict[str, str]:
  """A checkpoint path and the step directory it resolves to (a workdir or
  T5X model directory means its latest step, which may move on)."""
  path = os.path.abspath(os.fspath(path))
  return {"path": path,
          "resolved": os.path.abspath(pretrained.resolve_checkpoint(path))}


class PrecomputedReference:
  """One run's precomputed reference log-probs (module docstring)."""

  def __init__(self, trainer):
    self._trainer = trainer
    self.completion_fields = alignment_kinds.get_kind(
        trainer.algorithm.data).completion_fields
    # Loaded (or computed) before the first batch: `prepare`.
    self.table = None

  def spec(self, batch_size: int) -> Dict[str, jax.ShapeDtypeStruct]:
    """{feature: jax.ShapeDtypeStruct} of the `reference_logp_*` features
    `with_logprobs` adds to a global batch."""
    return {reference_cache.feature_name(f): jax.ShapeDtypeStruct(
        (batch_size,), np.float32) for f in self.completion_fields}

  def logprobs(self, batch, names):
    """{name: [batch] log pi_ref(completion | prompt)} from the batch's
    `reference_logp_*` features."""
    missing = [n for n in names
               if reference_cache.feature_name(n) not in batch]
    if missing:
      raise ValueError(
          f"config.reference_logprobs.mode='precomputed', but the batch has "
          f"no {[reference_cache.feature_name(n) for n in missing]}: read "
          "training batches from trainer.train_batches(), which adds them.")
    return {n: batch[reference_cache.feature_name(n)] for n in names}

  def with_logprobs(self, batches):
    """Training batches with each example's `reference_logp_*` added."""
    if self.table is None:
      self.prepare(self._trainer.initial_policy_params, new_run=False)
    return reference_cache.WithReferenceLogprobs(
        batches, self.table,
        {f: reference_cache.scoring_features(self._trainer.lm, f)
         for f in self.completion_fields})

  def cache_dir(self) -> str:
    trainer = self._trainer
    cfg = trainer.config.reference_logprobs
    if cfg.cache_dir:
      return cfg.cache_dir
    if trainer.workdir:
      return os.path.join(trainer.workdir, "reference_logprobs")
    raise ValueError(
        "config.reference_logprobs.cache_dir: unset, and this trainer was "
        "not given a workdir to put the precomputed reference log-probs in; "
        "set it to a directory.")

  def fingerprint(self) -> Dict:
    """What the precomputed values depend on; a cache with another one is
    not reused."""
    trainer = self._trainer
    cfg = trainer.config
    path = trainer.algorithm.networks.checkpoints(trainer).get(
        "params/policy")
    return {
        "reference": (checkpoint_fingerprint(path) if path
                      else {"random_init_seed": cfg.seed}),
        "model": cfg.model.to_dict(),
        "task": cfg.data.task,
        "split": cfg.data.train_split,
        "data_files": cfg.data.files.to_dict(),
        "feature_lengths": dict(trainer.feature_lengths),
        "feature_converter": type(trainer.feature_converter).__name__,
        "completion_fields": list(self.completion_fields),
    }

  def prepare(self, reference_params: Callable, new_run: bool) -> None:
    """Loads the precomputed values, computing them first when the cache is
    absent, or stale in a new run (a stale cache of a resumed run is a
    CacheMismatchError). `reference_params`: () -> the reference's
    parameters, called only when they must be computed."""
    # The data stack loads here, where the data is read, not with the config.
    import seqio  # pylint: disable=g-import-not-at-top
    from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
    config = self._trainer.config
    if isinstance(pipeline.get_task(config.data.task), seqio.Mixture):
      raise ValueError(
          f"config.data.task: {config.data.task!r} is a seqio mixture; "
          "precomputed reference log-probs need one pass that sees every "
          "training example, which a mixture's sampling does not promise. "
          "Train on a task, or use reference_logprobs.mode='in_step'.")
    directory = self.cache_dir()
    expected = self.fingerprint()
    try:
      table = reference_cache.load(directory, expected)
    except reference_cache.CacheMismatchError as e:
      if not new_run:
        raise
      console.log(f"{e} This is a new run, so it recomputes them.")
      table = None
    if table is not None:
      console.log(f"Using {len(table)} precomputed reference log-probs from "
                  f"{directory}")
    else:
      table = self._build(reference_params(), directory, expected)
    self.table = table

  def _build(self, params, directory, expected):
    # The data stack loads here, where the data is read, not with the config.
    from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
    trainer = self._trainer
    cfg = trainer.config
    global_size = (cfg.reference_logprobs.batch_size
                   or cfg.train.batch_size // cfg.train.num_microbatches)
    dp = sharding.data_parallel_size(trainer.mesh, trainer.rules)
    if global_size % dp or global_size % jax.process_count():
      raise ValueError(
          f"config.reference_logprobs.batch_size: {global_size} rows cannot "
          f"be split over {dp} data-parallel shards and "
          f"{jax.process_count()} processes; use a multiple of both.")
    fields = self.completion_fields
    # The reference's own placement: the policy's, or a LoRA run's base
    # (possibly with its adapters at zero beside it).
    score_fn = jax.jit(
        lambda p, b: scoring.sequence_logprobs(trainer.lm, p, b, fields),
        in_shardings=(jax.tree.map(lambda x: x.sharding, params),
                      sharding.batch_sharding(trainer.mesh, trainer.rules,
                                              1)),
        out_shardings=sharding.replicated(trainer.mesh))

    def score(local_batch):
      return score_fn(params, sharding.global_batch(local_batch, trainer.mesh,
                                                    trainer.rules))

    batches = pipeline.BatchIterator(
        cfg.data.task, cfg.data.train_split, trainer.feature_lengths,
        trainer.feature_converter, global_size, seed=cfg.seed, shuffle=False,
        num_epochs=1, drop_remainder=False)
    # Only for progress lines; a source may not know its size.
    total = pipeline.get_task(cfg.data.task).num_input_examples(
        cfg.data.train_split)
    console.log(f"Precomputing reference log-probs of {cfg.data.task}:"
                f"{cfg.data.train_split} into {directory}")
    keys, logprobs = reference_cache.compute(
        batches, pipeline.local_batch_size(global_size), score,
        {f: reference_cache.scoring_features(trainer.lm, f) for f in fields},
        total_examples=total)
    reference_cache.write(directory, expected, keys, logprobs)
    return reference_cache.load(directory, expected)

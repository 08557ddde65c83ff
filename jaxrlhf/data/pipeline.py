"""seqio tasks to fixed-shape numpy batches, deterministic and resumable.

Each process reads only its shard of the examples (seqio's ShardInfo) and
yields its share of every global batch; `jaxrlhf.sharding.global_batch` joins
the shares into one global array. The iterator's position is the number of
batches it has yielded: a run that restores position p resumes with exactly
the batch an uninterrupted run would have read next.
"""

import functools
import importlib
from typing import Dict, Iterator, Mapping, Optional

import jax
import numpy as np
import seqio
import tensorflow as tf

from jaxrlhf.data import feature_converters
from jaxrlhf.data import tasks as _builtin_tasks  # registers built-in tasks

del _builtin_tasks


def import_task_modules(modules) -> None:
  for name in modules:
    importlib.import_module(name)


def get_task(name: str, field: str = "config.data.task"):
  """The registered seqio task or mixture, or a one-line error to fix
  `field`, the config field that named it."""
  try:
    return seqio.get_mixture_or_task(name)
  except (ValueError, KeyError) as e:
    known = sorted(seqio.TaskRegistry.names())
    raise ValueError(
        f"{field}: no seqio task or mixture named {name!r} is "
        f"registered. Known tasks: {known}. Register it before training, or "
        "list the module that registers it in config.data.task_modules."
    ) from e


# How many pipelines were built again with AutoGraph (`traced_as_written`).
autograph_fallbacks = 0


def traced_as_written(build):
  """`build`, a function that makes tf.data pipelines, with AutoGraph off.

  tf.data's `map` first has AutoGraph rewrite each function from its source
  (Python control flow into TensorFlow's), then traces it. None of the map
  functions of seqio's preprocessors, our feature converters or our tasks
  needs the rewrite, and it was half the time of building a run's first
  pipelines (a tiny SFT run's training and evaluation ones: 3.2 s -> 1.5 s
  on 2 cores; later ones reuse the rewrites). A user's preprocessor that
  does need it (a Python `if` or `for` on a tensor) raises when traced as
  written; then `build` runs again with AutoGraph on. The pipeline's
  examples are the same either way.
  """

  @functools.wraps(build)
  def wrapper(*args, **kwargs):
    global autograph_fallbacks
    try:
      return tf.autograph.experimental.do_not_convert(build)(*args, **kwargs)
    except tf.errors.OperatorNotAllowedInGraphError:
      autograph_fallbacks += 1
      return build(*args, **kwargs)

  return wrapper


def local_batch_size(global_batch_size: int) -> int:
  count = jax.process_count()
  if global_batch_size % count:
    raise ValueError(f"batch size {global_batch_size} is not divisible by the "
                     f"number of processes {count}.")
  return global_batch_size // count


class BatchIterator:
  """This process's share of consecutive global batches of a seqio task.

  Args:
    task: seqio task or mixture name.
    split: dataset split.
    feature_lengths: task feature lengths, e.g. {"inputs": 16, "targets": 16}.
    feature_converter: turns task features into model features.
    global_batch_size: examples per batch over all processes.
    seed: shuffle seed; the same seed gives the same batches.
    shuffle: shuffle examples (training) or keep their order (evaluation).
    num_epochs: None repeats forever.
    position: batches already consumed (to resume).
    drop_remainder: drop a last batch smaller than the batch size (training
      needs fixed shapes); False keeps it, for passes that must see every
      example once (precomputed reference log-probs).
    pack: 0 lays out one example per row; k > 0 packs up to k examples
      into each row (`feature_converters.Packer`), and `global_batch_size`
      then counts rows.
  """

  @traced_as_written
  def __init__(self, task: str, split: str, feature_lengths: Mapping[str, int],
               feature_converter: seqio.FeatureConverter,
               global_batch_size: int, seed: int, shuffle: bool = True,
               num_epochs: Optional[int] = None, position: int = 0,
               drop_remainder: bool = True, pack: int = 0):
    self.position = position
    shard = seqio.ShardInfo(index=jax.process_index(),
                            num_shards=jax.process_count())
    task_obj = get_task(task)
    options = {}
    if (isinstance(task_obj, seqio.Task)
        and task_obj.source.performs_internal_shuffling):
      # seqio caches a split of fewer than 10,000 examples in memory after
      # its source: every pass would replay the first pass's permutation.
      options["try_in_mem_cache"] = False
    ds = task_obj.get_dataset(
        dict(feature_lengths), split=split, shuffle=shuffle,
        num_epochs=num_epochs, shard_info=shard, seed=seed, **options)
    ds = feature_converter(ds, dict(feature_lengths))
    if pack:
      ds = feature_converters.Packer(ds.element_spec, pack)(ds)
    ds = ds.batch(local_batch_size(global_batch_size),
                  drop_remainder=drop_remainder)
    # No autotuning: its model thread, optimising in the background, made
    # dropping the iterator at the end of a run wait for it (13 s after a
    # 300-step KTO stage on 2 cores, with nothing left to read). The
    # pipeline is a few tokenising maps, light beside a train step; with
    # autotuning off, its parallel maps run at tf.data's fixed default
    # parallelism. The order of the examples does not change.
    options = tf.data.Options()
    options.autotune.enabled = False
    ds = ds.with_options(options)
    self._iterator = ds.skip(position).as_numpy_iterator()

  def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    batch = next(self._iterator)
    self.position += 1
    return batch


@traced_as_written
def eval_examples(task: str, split: str, feature_lengths: Mapping[str, int],
                  feature_converter: seqio.FeatureConverter,
                  num_examples: int):
  """The first `num_examples` of a split, in order, with their texts.

  Returns (features, texts): features are numpy arrays [n, ...] for this
  process's shard; texts are this shard's {"inputs", "targets"} strings.
  """
  shard = seqio.ShardInfo(index=jax.process_index(),
                          num_shards=jax.process_count())
  task_obj = get_task(task)
  options = {}
  if isinstance(task_obj, seqio.Task):
    # seqio caches a small split in memory on first read; reading only its
    # first examples would make tf.data discard that cache with a warning.
    options["try_in_mem_cache"] = False

  # Read twice (texts, then features): the pass is in file order.
  examples = task_obj.get_dataset(dict(feature_lengths), split=split,
                                  shuffle=False, shard_info=shard,
                                  num_epochs=1, **options)
  per_process = num_examples // jax.process_count()
  raw = list(examples.take(per_process).as_numpy_iterator())
  texts = [{k: ex[f"{k}_pretokenized"].decode() for k in ("inputs", "targets")
            if f"{k}_pretokenized" in ex} for ex in raw]
  ds = feature_converter(examples, dict(feature_lengths))
  rows = list(ds.take(per_process).as_numpy_iterator())
  features = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  return features, texts

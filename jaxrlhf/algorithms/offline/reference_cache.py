"""Reference log-probs precomputed once over the training data.

With `config.reference_logprobs.mode = "precomputed"`, a DPO-family or DRO-V
run scores every (prompt, completion) of its training split with the
reference policy once, before the first step, and stores
log pi_ref(completion | prompt) in a cache directory. Each training batch
then carries `reference_logp_<completion field>` ([batch] float32) and the
loss reads those instead of running a frozen reference, so training neither
holds nor runs it (TRL's `precompute_ref_log_probs` does the same). In the
offline losses this serves (the DRO paper's general pairwise loss of section
2, which covers DPO, IPO and SLiC, and DRO-V's equation 4) the reference
enters only as log pi_ref(y_i | x_i) of each dataset example: a constant of
the data, independent of the rest of the batch. (KTO's KL baseline pairs
prompts with other examples' completions, so it is not one.)

Values are found by content, not by position: the key of a completion is a
64-bit hash of exactly the features the scoring API reads to score it (the
prompt's and the completion's tokens, masks and positions). The training
stream is therefore untouched: the same shuffling, the same batches and the
same resume position as an in-step run, on any number of processes. A
(prompt, completion) that occurs twice shares one entry, and an example the
cache does not hold (the data changed) is an error, never a silent value.

Directory layout:
  manifest.json   fingerprint, build directory, part files and their entry
                  counts. Written last, as a temporary file renamed into
                  place, so a cache without it is half-written and is never
                  read.
  build-<id>/part-<p>-of-<n>.npz   one per process: `keys` uint64 [n],
                  `logprobs` float32 [n].

The fingerprint says what made the values (reference checkpoint path and the
step it resolved to, model config, task, split, feature lengths, converter);
a cache whose fingerprint differs is never used (`CacheMismatchError`).
"""

import hashlib
import io
import json
import os
import time
from typing import Callable, Dict, Iterator, List, Mapping, Optional
from typing import Sequence, Tuple

import jax
import numpy as np

from jaxrlhf import console

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FEATURE_PREFIX = "reference_logp_"
# Two scorings of one (prompt, completion) in different batches differ only by
# float reduction order; a shared key with values further apart than this is
# a hash collision, not a repeat.
_REPEAT_TOLERANCE = 1e-2


class CacheMismatchError(ValueError):
  """The cache directory holds values made for a different run setup."""


class MissingExampleError(ValueError):
  """A training example has no precomputed reference log-prob."""


def feature_name(completion_field: str) -> str:
  """Batch feature carrying the precomputed log-prob of a completion field."""
  return FEATURE_PREFIX + completion_field


def scoring_features(lm, completion_field: str) -> Tuple[str, ...]:
  """The batch features the scoring API reads to score `completion_field`.

  Args:
    lm: a scoring adapter (jaxrlhf.models.scoring.adapter_for).
    completion_field: e.g. "chosen", "rejected", "completion".
  """
  features = list(lm.completion_keys(completion_field))
  if lm.is_encoder_decoder:
    # The encoder reads the prompt; decoder-only completion rows hold the
    # prompt already (their prompt_* features only serve generation).
    features += list(lm.prompt_keys)
  return tuple(features)


def row_keys(batch: Mapping[str, np.ndarray],
             features: Sequence[str]) -> np.ndarray:
  """[batch] uint64 content keys: a hash of each row of `features`.

  Every feature has a fixed width within a run (the fingerprint pins the
  lengths), so concatenating a row's bytes in the order of `features` is
  unambiguous.
  """
  arrays = [np.ascontiguousarray(np.asarray(batch[f]), dtype=np.int32)
            for f in features]
  n = arrays[0].shape[0]
  keys = np.empty(n, np.uint64)
  for i in range(n):
    digest = hashlib.blake2b(digest_size=8)
    for array in arrays:
      digest.update(array[i].tobytes())
    keys[i] = int.from_bytes(digest.digest(), "little")
  return keys


class ReferenceTable:
  """Sorted content keys and their reference log-probs.

  Args:
    keys: [n] uint64, any order, repeats allowed.
    logprobs: [n] float32 sequence log-probs under the reference.
  """

  def __init__(self, keys: np.ndarray, logprobs: np.ndarray):
    keys = np.asarray(keys, np.uint64)
    logprobs = np.asarray(logprobs, np.float32)
    if keys.shape != logprobs.shape or keys.ndim != 1:
      raise ValueError(f"keys {keys.shape} and logprobs {logprobs.shape} must "
                       "be matching vectors.")
    order = np.argsort(keys, kind="stable")
    keys, logprobs = keys[order], logprobs[order]
    repeat = np.flatnonzero(keys[1:] == keys[:-1])
    if repeat.size:
      a, b = logprobs[repeat], logprobs[repeat + 1]
      bad = np.abs(a - b) > _REPEAT_TOLERANCE * np.maximum(1.0, np.abs(a))
      if np.any(bad):
        i = repeat[np.argmax(bad)]
        raise ValueError(
            f"reference log-prob cache: key {keys[i]:#x} holds {a[bad][0]} "
            f"and {b[bad][0]}, a 64-bit hash collision between different "
            "completions. Delete the cache directory and run again.")
    first = np.ones(keys.shape, bool)
    first[1:] = keys[1:] != keys[:-1]
    self.keys = keys[first]
    self.logprobs = logprobs[first]

  def __len__(self) -> int:
    return int(self.keys.size)

  def lookup(self, keys: np.ndarray, what: str = "completion") -> np.ndarray:
    """[batch] float32 log-probs of `keys`; an unknown key is an error."""
    keys = np.asarray(keys, np.uint64)
    index = np.minimum(np.searchsorted(self.keys, keys), max(len(self) - 1, 0))
    found = (self.keys[index] == keys) if len(self) else np.zeros_like(keys,
                                                                       bool)
    if not np.all(found):
      raise MissingExampleError(
          f"{int(np.sum(~found))} {what} rows of this batch have no "
          "precomputed reference log-prob: the training data differ from "
          "the data the cache was built from (a changed file, or a task "
          "whose preprocessing is random). Delete the cache directory "
          "(config.reference_logprobs.cache_dir) and use a fresh workdir, "
          "or use config.reference_logprobs.mode='in_step'.")
    return self.logprobs[index]


class WithReferenceLogprobs:
  """Adds `reference_logp_<field>` [batch] to each batch of `batches`.

  Args:
    batches: an iterator of numpy batches with a `position` attribute (the
      training loop checkpoints it), e.g. jaxrlhf.data.pipeline.BatchIterator.
    table: the precomputed values.
    features_by_field: completion field -> its `scoring_features`.
  """

  def __init__(self, batches, table: ReferenceTable,
               features_by_field: Mapping[str, Sequence[str]]):
    self._batches = batches
    self._table = table
    self._features = dict(features_by_field)

  @property
  def position(self) -> int:
    return self._batches.position

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    batch = dict(next(self._batches))
    for field, features in self._features.items():
      batch[feature_name(field)] = self._table.lookup(
          row_keys(batch, features), what=repr(field))
    return batch


# --- the cache directory -----------------------------------------------------


def _canonical(value) -> str:
  return json.dumps(value, sort_keys=True, default=str)


def _differing(a: Mapping, b: Mapping) -> List[str]:
  return sorted(k for k in set(a) | set(b)
                if _canonical(a.get(k)) != _canonical(b.get(k)))


def _write_atomically(path: str, data: bytes) -> None:
  # The data stack loads here, where the data is read, not with the config.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tmp = f"{path}.tmp-{jax.process_index()}"
  with tf.io.gfile.GFile(tmp, "wb") as f:
    f.write(data)
  tf.io.gfile.rename(tmp, path, overwrite=True)


def read_manifest(directory: str) -> Optional[dict]:
  """The cache's manifest, or None when there is no complete cache."""
  # The data stack loads here, where the data is read, not with the config.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = os.path.join(directory, MANIFEST)
  if not tf.io.gfile.exists(path):
    return None
  with tf.io.gfile.GFile(path, "r") as f:
    return json.load(f)


def load(directory: str, fingerprint: Mapping) -> Optional[ReferenceTable]:
  """The cached table, None when there is none, or CacheMismatchError.

  Args:
    directory: the cache directory.
    fingerprint: what the caller's values must have been made from
      (JSON-serialisable); it must equal the stored one.
  """
  # The data stack loads here, where the data is read, not with the config.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  manifest = read_manifest(directory)
  if manifest is None:
    return None
  stored = manifest.get("fingerprint", {})
  wanted = json.loads(_canonical(dict(fingerprint)))
  if manifest.get("format") != FORMAT_VERSION or _canonical(
      stored) != _canonical(wanted):
    fields = _differing(stored, wanted) or ["format"]
    raise CacheMismatchError(
        f"The precomputed reference log-probs in {directory} were made for a "
        f"different setup (differing: {', '.join(fields)}; stored "
        f"{ {k: stored.get(k) for k in fields} }, this run "
        f"{ {k: wanted.get(k) for k in fields} }). A resumed run was trained "
        "with them and does not recompute them silently: resume with the "
        "config and reference checkpoint that made them, or start a fresh "
        "workdir (a new run recomputes them).")
  keys, logprobs = [], []
  build_dir = os.path.join(directory, manifest["build"])
  for name, count in manifest["parts"].items():
    with tf.io.gfile.GFile(os.path.join(build_dir, name), "rb") as f:
      part = np.load(io.BytesIO(f.read()))
      part_keys, part_logprobs = part["keys"], part["logprobs"]
    if part_keys.size != count or part_logprobs.size != count:
      raise ValueError(f"{os.path.join(build_dir, name)} holds "
                       f"{part_keys.size} entries, its manifest says {count}; "
                       f"delete {directory} and run again.")
    keys.append(part_keys)
    logprobs.append(part_logprobs)
  return ReferenceTable(np.concatenate(keys), np.concatenate(logprobs))


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def _rows_over_processes(rows: int) -> int:
  """The sum of every process's `rows` (all processes must call it)."""
  if jax.process_count() == 1:
    return rows
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.sum(multihost_utils.process_allgather(
      np.array([rows], np.int64))))


def _pad_rows(batch: Mapping[str, np.ndarray], rows: int
              ) -> Dict[str, np.ndarray]:
  """Pads (with zeros) or builds a batch of exactly `rows` rows."""
  out = {}
  for k, v in batch.items():
    pad = rows - v.shape[0]
    out[k] = (v if pad == 0 else
              np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]))
  return out


def compute(batches: Iterator[Mapping[str, np.ndarray]], local_batch_size: int,
            score: Callable[[Mapping[str, np.ndarray]], Mapping[str, object]],
            features_by_field: Mapping[str, Sequence[str]],
            total_examples: Optional[int] = None,
            log_every_seconds: float = 30.0
            ) -> Tuple[np.ndarray, np.ndarray]:
  """Scores this process's share of the data, one global batch at a time.

  Args:
    batches: this process's numpy batches of at most `local_batch_size` rows,
      each example once (the last batch may be short).
    local_batch_size: rows per process per forward pass.
    score: local numpy batch -> {field: [global batch] sequence log-probs,
      replicated}; it joins the processes' shares (jaxrlhf.sharding
      .global_batch) and runs the jit-compiled reference.
    features_by_field: completion field -> its `scoring_features`.
    total_examples: the split's size when known (for progress lines).
  Returns:
    (keys uint64 [n], logprobs float32 [n]) of this process's completions.

  Every process runs the same number of forward passes (collectives need
  it): a process that has run out of data feeds zero rows, and short
  batches are padded; padded rows are dropped.
  """
  keys, values = [], []
  template = None
  done, start, last_log = 0, time.time(), time.time()
  row0 = jax.process_index() * local_batch_size
  while True:
    local = next(batches, None)
    rows = 0 if local is None else next(iter(local.values())).shape[0]
    global_rows = _rows_over_processes(rows)
    if not global_rows:
      break
    if local is not None and template is None:
      template = {k: np.zeros_like(v[:0]) for k, v in local.items()}
    if local is None and template is None:
      raise ValueError(
          f"process {jax.process_index()} holds no training example, so it "
          "cannot take part in the precomputation of reference log-probs; "
          "use more training data than processes.")
    local = local if local is not None else template
    out = score(_pad_rows(local, local_batch_size))
    for field, features in features_by_field.items():
      logprobs = np.asarray(out[field])[row0:row0 + rows]
      keys.append(row_keys(local, features))
      values.append(logprobs.astype(np.float32))
    done += global_rows
    if time.time() - last_log >= log_every_seconds:
      last_log = time.time()
      of = f" of {total_examples}" if total_examples else ""
      console.log(f"Reference log-probs: {done}{of} examples scored, "
                      f"{done / (last_log - start):.1f} examples/s")
  console.log(f"Reference log-probs: {done} examples scored in "
                  f"{time.time() - start:.1f}s")
  if not keys:
    return np.zeros([0], np.uint64), np.zeros([0], np.float32)
  return np.concatenate(keys), np.concatenate(values)


def write(directory: str, fingerprint: Mapping, keys: np.ndarray,
          logprobs: np.ndarray) -> None:
  """Stores this process's part; process 0 then commits the manifest.

  All processes must call it (it synchronises them). Part files and the
  manifest are each written to a temporary name and renamed; the manifest
  comes last, so readers see either the previous complete cache or the new
  one. The build directory is named after the fingerprint, so a crashed
  build's leftovers are overwritten by the next build of the same setup.
  """
  # The data stack loads here, where the data is read, not with the config.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  fingerprint = json.loads(_canonical(dict(fingerprint)))
  build = "build-" + hashlib.sha256(
      _canonical(fingerprint).encode()).hexdigest()[:16]
  build_dir = os.path.join(directory, build)
  tf.io.gfile.makedirs(build_dir)
  count = jax.process_count()
  name = f"part-{jax.process_index():05d}-of-{count:05d}.npz"
  buffer = io.BytesIO()
  np.savez(buffer, keys=np.asarray(keys, np.uint64),
           logprobs=np.asarray(logprobs, np.float32))
  _write_atomically(os.path.join(build_dir, name), buffer.getvalue())
  sizes = _gather_sizes(int(keys.size))
  _barrier("reference_cache_parts_written")
  if jax.process_index() == 0:
    previous = read_manifest(directory)
    manifest = {
        "format": FORMAT_VERSION, "fingerprint": fingerprint, "build": build,
        "parts": {f"part-{p:05d}-of-{count:05d}.npz": sizes[p]
                  for p in range(count)}}
    _write_atomically(os.path.join(directory, MANIFEST),
                      json.dumps(manifest, indent=1).encode())
    if previous and previous.get("build") not in (None, build):
      old = os.path.join(directory, previous["build"])
      if tf.io.gfile.exists(old):
        tf.io.gfile.rmtree(old)
  _barrier("reference_cache_manifest_written")


def _gather_sizes(size: int) -> List[int]:
  if jax.process_count() == 1:
    return [size]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return [int(s) for s in np.ravel(
      multihost_utils.process_allgather(np.array([size], np.int64)))]

"""Accuracy on held-out preference pairs, overall and by group.

The PPO implementation-details paper reports a reward model's validation
accuracy per annotation batch and per annotator confidence (detail 16,
its Table 5: batches differ from 0.51 to 0.77 for one model), and compares
it with the accuracy of DPO's implicit reward, beta * (log pi - log
pi_ref), on the same pairs (detail 19). Both are the share of pairs whose
chosen completion gets the higher reward (ties count 1/2), here reported
overall and for each group the pairs carry:

  <prefix>_batch<b>        pairs of annotation batch b (TL;DR's "batch6" is
                           6; pairs of no known batch are left out)
  <prefix>_confidence<c>   pairs whose annotator confidence is c (on the
                           raters' scale: TL;DR's 1-9), when the pairs have
                           more than one confidence
"""

from typing import Dict, Mapping, Optional

import jax
import numpy as np

from jaxrlhf.eval import evaluation


def gather_rows(x: np.ndarray) -> np.ndarray:
  """Every process's rows of `x` [n, ...], in process order (n may differ
  between processes)."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  sizes = np.asarray(multihost_utils.process_allgather(
      np.array([len(x)], np.int64))).reshape(-1)
  padded = np.zeros((int(sizes.max()),) + x.shape[1:], x.dtype)
  padded[:len(x)] = x
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return np.concatenate([rows[i, :sizes[i]] for i in range(len(sizes))])


def wins(chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
  """[n] 1 where the chosen completion's reward is higher, 1/2 on ties."""
  return (chosen > rejected) + 0.5 * (chosen == rejected)


def confidence_scale(task_name: str) -> Optional[float]:
  """The factor a file layout divided annotator confidences by (TL;DR: 9),
  to report them on the raters' scale; None if the task's source has none."""
  # The data stack (seqio) loads with the data, not with the config.
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  source = getattr(pipeline.get_task(task_name), "source", None)
  options = getattr(source, "layout_options", None) or {}
  return options.get("confidence_scale")


def _label(value: float) -> str:
  return f"{float(np.round(value, 6)):g}"


def grouped_accuracy(correct: np.ndarray, features: Mapping[str, np.ndarray],
                     prefix: str, scale: Optional[float] = None
                     ) -> Dict[str, float]:
  """Accuracy by annotation batch and by confidence (module docstring).

  Args:
    correct: [n] this process's outcomes (1, 1/2, 0) of the pairs.
    features: the pairs' features; `annotation_batch` and `confidence`
      [n] are read when present.
    prefix: the metric name, e.g. "eval/accuracy".
    scale: confidences are multiplied by it for their labels.
  """
  out = {}
  correct = gather_rows(np.asarray(correct, np.float64))
  groups = (("batch", "annotation_batch", 1.0, lambda v: v >= 0, 1),
            ("confidence", "confidence", scale or 1.0, lambda v: True, 2))
  for name, feature, factor, known, at_least in groups:
    if feature not in features:
      continue
    values = gather_rows(np.asarray(features[feature], np.float64))
    distinct = sorted({float(v) for v in values if known(v)})
    if len(distinct) < at_least:
      continue
    for value in distinct:
      label = _label(value * factor)
      out[f"{prefix}_{name}{label}"] = float(np.mean(correct[values == value]))
  return out


def pair_metrics(chosen: np.ndarray, rejected: np.ndarray,
                 features: Mapping[str, np.ndarray], name: str,
                 scale: Optional[float] = None) -> Dict[str, float]:
  """Metrics of rewards of this process's pairs [n]: eval/<name>_accuracy
  (over all processes' pairs), eval/<name>_margin (the mean chosen minus
  rejected reward) and the accuracy by group."""
  chosen = np.asarray(chosen, np.float64)
  rejected = np.asarray(rejected, np.float64)
  correct = wins(chosen, rejected)
  n = len(correct)
  prefix = f"eval/{name}_accuracy"
  out = {prefix: evaluation.global_mean(float(correct.sum()), n),
         f"eval/{name}_margin": evaluation.global_mean(
             float((chosen - rejected).sum()), n)}
  out.update(grouped_accuracy(correct, features, prefix, scale))
  return out

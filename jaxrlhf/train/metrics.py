"""Metrics out of a run: TensorBoard, metrics.jsonl, and console progress."""

import datetime
import json
import os
import time
from typing import Mapping, Optional

import jax
from clu import metric_writers


class MetricsLogger:
  """Writes scalars to TensorBoard event files (clu) and, mirrored, to
  `<workdir>/metrics.jsonl`, one JSON object per line with its "step".

  Only process 0 writes files; every process may call it.
  """

  def __init__(self, workdir: str, resume_step: Optional[int] = None):
    self._is_main = jax.process_index() == 0
    self._path = os.path.join(workdir, "metrics.jsonl")
    self._rows = []
    if os.path.exists(self._path):
      with open(self._path) as f:
        self._rows = [json.loads(line) for line in f if line.strip()]
      # Steps past the resumed checkpoint will be trained (and logged)
      # again; a run with no checkpoint (None) starts over.
      self._rows = [r for r in self._rows
                    if resume_step is not None and r["step"] <= resume_step]
    self._writer = metric_writers.create_default_writer(
        workdir, just_logging=not self._is_main, asynchronous=False)
    self._jsonl = None
    if self._is_main:
      with open(self._path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in self._rows)
      os.replace(self._path + ".tmp", self._path)
      self._jsonl = open(self._path, "a")

  def eval_before(self):
    """The step-0 evaluation of this run, as "eval_before/..." scalars."""
    for row in self._rows:
      if row["step"] == 0:
        return {k.replace("eval/", "eval_before/"): v for k, v in row.items()
                if k.startswith("eval/")}
    return {}

  def eval_at(self, step: int):
    """The "eval/..." scalars logged at `step` (the last such row), or {}."""
    for row in reversed(self._rows):
      if row["step"] == step and any(k.startswith("eval/") for k in row):
        return {k: v for k, v in row.items() if k.startswith("eval/")}
    return {}

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    scalars = {k: float(v) for k, v in scalars.items()}
    self._writer.write_scalars(step, scalars)
    if self._jsonl:
      self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
      self._jsonl.flush()

  def close(self):
    self._writer.flush()
    self._writer.close()
    if self._jsonl:
      self._jsonl.close()


class Progress:
  """One console line per log interval: step, loss, steps/s, tokens/s, ETA."""

  def __init__(self, total_steps: int, start_step: int):
    self._total = total_steps
    self._last_step = start_step
    self._last_time = time.perf_counter()

  def line(self, step: int, loss: float, tokens: float) -> str:
    now = time.perf_counter()
    steps = max(step - self._last_step, 1)
    elapsed = max(now - self._last_time, 1e-9)
    steps_per_s = steps / elapsed
    eta = datetime.timedelta(seconds=round((self._total - step) / steps_per_s))
    self._last_step, self._last_time = step, now
    return (f"step {step}/{self._total} | loss {loss:.4f} | "
            f"{steps_per_s:.2f} steps/s | {tokens / elapsed:,.0f} tokens/s | "
            f"ETA {eta}")

"""Metrics out of a run: TensorBoard, metrics.jsonl, wandb (optional), and
console progress."""

import datetime
import json
import time
from typing import Dict, List, Mapping, Optional

from clu import metric_writers
from etils import epath
import jax

from jaxrlhf import console
from jaxrlhf.train import files
from jaxrlhf.train import wandb_writer

METRICS = "metrics.jsonl"


def read_rows(path) -> List[Dict]:
  """The rows of a metrics.jsonl; a line that is not a JSON row (the last
  one, cut short by a kill or a full disk) is dropped with a line saying
  so."""
  path = epath.Path(path)
  if not path.exists():
    return []
  rows = []
  for number, line in enumerate(path.read_text().splitlines(), start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      if not isinstance(row, dict) or "step" not in row:
        raise ValueError("not a row with a step")
    except ValueError:
      console.log(f"{path}: line {number} is not a complete metrics row (a "
                  "write was interrupted); dropped it.")
      continue
    rows.append(row)
  return rows


class MetricsLogger:
  """Writes scalars to TensorBoard event files (clu), to wandb with
  config.train.wandb on (one more clu writer), and, mirrored, to
  `<workdir>/metrics.jsonl`, one JSON object per line with its "step".

  Only process 0 writes files and logs to wandb; every process may call
  it. A write that fails for lack of space raises files.WriteError in one
  line, and leaves metrics.jsonl ending at its last complete row.

  Args:
    workdir: the run's directory (local or gs://).
    resume_step: the step of the checkpoint the run resumes from: the rows
      after it are dropped (they are trained and logged again), and None
      (a start from scratch) drops every row.
    config: the run's config (None: no wandb).
  """

  def __init__(self, workdir: str, resume_step: Optional[int] = None,
               config=None):
    self._is_main = jax.process_index() == 0
    self._path = epath.Path(workdir) / METRICS
    self._rows = [r for r in read_rows(self._path)
                  if resume_step is not None and r["step"] <= resume_step]
    self._remote = files.is_remote(self._path)
    self._jsonl = None
    # wandb first: its start is the one that may fail (no login, no
    # network), and then nothing else is open yet.
    wandb = (wandb_writer.create(config, workdir)
             if self._is_main and config is not None else None)
    self._writer = metric_writers.create_default_writer(
        workdir, just_logging=not self._is_main, asynchronous=False)
    if wandb is not None:
      self._writer = metric_writers.MultiWriter([self._writer, wandb])
    if self._is_main:
      files.write_atomically(self._path, "".join(
          json.dumps(r) + "\n" for r in self._rows), str(self._path))
      if not self._remote:
        self._jsonl = open(self._path, "a")

  def eval_before(self):
    """The step-0 evaluation of this run, as "eval_before/..." scalars."""
    for row in self._rows:
      if row["step"] == 0 and any(k.startswith("eval/") for k in row):
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
    row = {"step": step, **scalars}
    try:
      self._writer.write_scalars(step, scalars)
    except Exception as e:  # pylint: disable=broad-except
      self._raise_write_failure(e, "the TensorBoard event file")
    if not self._is_main:
      return
    self._rows.append(row)
    if self._remote:
      # An object store cannot append: the file is written whole.
      files.write_atomically(self._path, "".join(
          json.dumps(r) + "\n" for r in self._rows), str(self._path))
      return
    end = self._jsonl.tell()
    try:
      self._jsonl.write(json.dumps(row) + "\n")
      self._jsonl.flush()
    except OSError as e:
      # Cut a half-written row, so the file ends at a complete one.
      try:
        self._jsonl.truncate(end)
      except OSError:
        pass
      self._raise_write_failure(e, str(self._path))

  def _raise_write_failure(self, error: BaseException, what: str) -> None:
    failure = files.write_failure(error, f"{what} in {self._path.parent}")
    if failure is None:
      raise error
    raise failure from None

  def close(self):
    try:
      self._writer.flush()
      self._writer.close()
    except Exception as e:  # pylint: disable=broad-except
      if files.write_failure(e, "") is None:
        raise
      # Raised already by the write that failed, or reported by the next.
    if self._jsonl:
      try:
        self._jsonl.close()
      except OSError:
        pass  # its rows were flushed one by one
      self._jsonl = None


class Progress:
  """One console line per log interval: step, loss, steps/s, tokens/s, ETA.

  The rates leave out the first step of a (re)started run, which compiles
  the step function: `first_step_done(step)` marks its end. Until then a
  line says how long the first step took instead.
  """

  def __init__(self, total_steps: int):
    self._total = total_steps
    self._start = time.perf_counter()
    self._last_step: Optional[int] = None
    self._last_time = 0.0

  def first_step_done(self, step: int) -> None:
    """The first step (compilation included) has finished at `step`."""
    if self._last_step is None:
      self._first_step_s = time.perf_counter() - self._start
      self._last_step, self._last_time = step, time.perf_counter()

  def timed(self, step: int) -> bool:
    """Whether `step` counts in the next line's rates (its tokens too)."""
    return self._last_step is not None and step > self._last_step

  def line(self, step: int, loss: float, tokens: float) -> str:
    """`tokens`: those of the steps `timed` since the last line."""
    head = f"step {step}/{self._total} | loss {loss:.4f}"
    now = time.perf_counter()
    if self._last_step is None or step <= self._last_step:
      took = getattr(self, "_first_step_s", now - self._start)
      return f"{head} | first step {took:.1f} s (compilation included)"
    steps = step - self._last_step
    elapsed = max(now - self._last_time, 1e-9)
    steps_per_s = steps / elapsed
    eta = datetime.timedelta(seconds=round((self._total - step) / steps_per_s))
    self._last_step, self._last_time = step, now
    return (f"{head} | {steps_per_s:.2f} steps/s | "
            f"{tokens / elapsed:,.0f} tokens/s | ETA {eta}")

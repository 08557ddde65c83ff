"""The training loop every algorithm shares.

It owns the mesh, checkpoints (save, keep, resume), preemption (SIGTERM and
SIGINT save at the next step boundary and exit), the non-finite guard,
metrics and console progress. It drives a `jaxrlhf.algorithms.trainer.Trainer`
through `init_state()` (or a restore into `abstract_state` and
`state_shardings`), `train_batches(position)`, `train_step(state, batch)`,
`tokens_in(local_batch)`, `evaluate(state)` and `finish_training(state)`.
"""

import os
import signal
from typing import Dict, List, Optional

import jax
import ml_collections
import numpy as np

from jaxrlhf import algorithms
from jaxrlhf import console
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.data import pipeline
from jaxrlhf.train import best as best_lib
from jaxrlhf.train import checkpointing
from jaxrlhf.train import metrics as metrics_lib


class NonFiniteError(RuntimeError):
  """A step produced a non-finite loss or gradient."""


class WorkdirError(ValueError):
  """The workdir cannot be used."""


class _StopFlag:
  """Set by SIGTERM/SIGINT; the loop checks it between steps."""

  def __init__(self):
    self.signal_name: Optional[str] = None
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: signals stay as they were
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def requested(self) -> bool:
    local = self.signal_name is not None
    if jax.process_count() == 1:
      return local
    # Every process must stop at the same step, or the collectives hang.
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.array([local], np.int32))
    return bool(np.any(flags))


def preflight(config: ml_collections.ConfigDict, workdir: str,
              devices=None) -> None:
  """Everything that can refuse a run from its config alone, before anything
  is written: the config's values, the mesh against the devices, the batch
  splits, the paths it reads, the tasks it names, and that a workdir is
  given."""
  if not workdir:
    raise WorkdirError("--workdir is required: a directory for checkpoints, "
                       "metrics and the resolved config.")
  defaults.validate(config)
  try:
    mesh = sharding.create_mesh(config.mesh.shape, config.mesh.axis_names,
                                devices)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
  algorithms.check_rows(config, sharding.data_parallel_size(
      mesh, sharding.as_rules(config.sharding.logical_axis_rules)))
  defaults.check_paths(config)
  pipeline.import_task_modules(config.data.task_modules)
  if not config.data.files.train:  # else the run registers it from files
    pipeline.get_task(config.data.task)
  if config.eval.task:
    pipeline.get_task(config.eval.task, field="config.eval.task")


def prepare_workdir(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Creates the workdir and writes the resolved config into it."""
  check_workdir(workdir)
  write_run_config(workdir, config)


def check_workdir(workdir: str) -> None:
  """Creates the workdir; a one-line WorkdirError if it is not writable."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_test_{jax.process_index()}")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(
        f"--workdir {workdir!r} is not a writable directory ({e.strerror}); "
        "choose a path you can write to.") from e


def write_run_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Writes the resolved config as `config.json` (atomically, process 0)."""
  if jax.process_index() == 0:
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    os.replace(path + ".tmp", path)


def train(config: ml_collections.ConfigDict, workdir: str,
          devices=None) -> Dict[str, float]:
  """Runs (or resumes) the run `config` describes in `workdir`, on a mesh of
  all devices (or of `devices`).

  Returns the final evaluation metrics, plus "eval_before/..." metrics when
  this call started from step 0.
  """
  preflight(config, workdir, devices)
  with sharding.activate(config, devices) as mesh:
    # Built before the workdir is touched: everything a trainer refuses
    # (data, model, batch splits, evaluation) leaves no trace.
    trainer = algorithms.build(config, mesh, workdir)
    # config.json is written once the run has started (its state restored or
    # initialised, its data readable): a run refused at start-up leaves the
    # config of the run that made the workdir's checkpoints in place.
    check_workdir(workdir)
    return _run(config, workdir, trainer)


def _run(config, workdir, trainer) -> Dict[str, float]:
  checkpointer = checkpointing.Checkpointer(
      os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep)
  best = best_lib.BestCheckpoint(config, workdir, trainer)
  total = config.train.num_steps
  restored = checkpointer.restore_latest(state_lib.abstract_with_shardings(
      trainer.abstract_state, trainer.state_shardings))
  latest = restored[0] if restored else None
  # Rows logged after the checkpoint we resume from (a crash between saves),
  # or by a start that never saved, are dropped, so that metrics.jsonl reads
  # as one uninterrupted run.
  logger = metrics_lib.MetricsLogger(workdir, resume_step=latest)
  summary: Dict[str, float] = {}
  if restored:
    _, state, position = restored
    summary.update(logger.eval_before())
    console.log(f"Resumed from checkpoint at step {latest} in "
                f"{checkpointer.directory}")
  else:
    state, position = trainer.init_state(), 0
  step = int(jax.device_get(state.step))
  batches = trainer.train_batches(position)
  # The first batch is read now, so that bad data stops the run before the
  # first evaluation (which can take minutes) rather than after it.
  first_batch = next(batches) if step < total else None
  write_run_config(workdir, config)
  if latest is None:
    before = trainer.evaluate(state)
    if before:
      logger.write(0, before)
      console.log(f"Before training ({trainer.evaluation_description()}): "
                      + _format(before))
    summary.update({k.replace("eval/", "eval_before/"): v
                    for k, v in before.items()})
    final = before  # the evaluation at step `step` (0 here)
  else:
    final = logger.eval_at(step)
  if step >= total and _all_processes_agree(bool(final) or latest is None):
    # A finished run: its final evaluation is in metrics.jsonl already.
    summary.update(final)
    console.log(f"Already at step {step} of {total}; nothing to train.")
    return summary
  progress = metrics_lib.Progress(total, step)
  pending: List = []  # (step, device metrics, tokens) not yet written
  eval_every = config.eval.every_steps
  ckpt_every = config.checkpoint.every_steps

  def flush():
    """Writes buffered metrics; raises at the first non-finite step."""
    host = jax.device_get([(s, m) for s, m, _ in pending])
    tokens = sum(t for _, _, t in pending)
    for s, m in host:
      if m.get("nonfinite", 0.0) > 0:
        raise NonFiniteError(
            f"Step {s} produced a non-finite loss or gradient (loss={m['loss']}, "
            f"grad_norm={m['grad_norm']}). The run stopped without saving; the "
            f"last good checkpoint (step {checkpointer.latest_step()}) is "
            "untouched. Lower optimizer.learning_rate or enable "
            "optimizer.grad_clip_norm, then resume.")
      logger.write(s, {k: v for k, v in m.items() if k != "nonfinite"})
    if host:
      s, m = host[-1]
      console.log(progress.line(s, m["loss"], tokens))
    pending.clear()

  try:
    with _StopFlag() as stop:
      while step < total:
        if first_batch is None:
          local = next(batches)
        else:
          local, first_batch = first_batch, None
        batch = sharding.global_batch(local, trainer.mesh, trainer.rules)
        state, step_metrics = trainer.train_step(state, batch)
        step += 1
        if step == total:
          # Before the final save, so the last checkpoint holds the result.
          state, final_metrics = trainer.finish_training(state)
          step_metrics = dict(step_metrics, **final_metrics)
        pending.append((step, step_metrics, trainer.tokens_in(local)))
        stopping = stop.requested()
        save_now = stopping or step == total or (
            ckpt_every and step % ckpt_every == 0)
        if save_now or step % config.train.log_every == 0:
          flush()
        if save_now:
          checkpointer.save(step, state, batches.position)
        if stopping:
          console.log(
              f"Received {stop.signal_name or 'a stop request'}: saved a "
              f"checkpoint at step {step} and stopped. Run the same command "
              "again to resume.")
          return summary
        if eval_every and step % eval_every == 0 and step < total:
          evaluated = trainer.evaluate(state)
          if evaluated:
            logger.write(step, evaluated)
            console.log(
                f"Evaluation (step {step}; "
                f"{trainer.evaluation_description()}): " + _format(evaluated))
          best.observe(step, evaluated, state)
    after = trainer.evaluate(state)
    if after:
      logger.write(step, after)
    summary.update(after)
    if after:
      console.log(f"After training (step {step}; "
                      f"{trainer.evaluation_description()}): " + _format(after))
    best.observe(step, after, state)
    summary.update(best.finish(state, step, logger))
    return summary
  finally:
    logger.close()
    checkpointer.close()
    best.close()


def _all_processes_agree(local: bool) -> bool:
  """`local` as process 0 sees it, on every process (control flow that
  leads to collectives must not differ between processes)."""
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(multihost_utils.broadcast_one_to_all(np.int32(local)))


def gold_reward_line(summary: Dict[str, float]) -> Optional[str]:
  """The run's closing line: held-out gold reward before -> after."""
  if "eval/gold_reward" not in summary:
    return None
  after = summary["eval/gold_reward"]
  before = summary.get("eval_before/gold_reward")
  # SFT evaluates greedy outputs; policy algorithms sample (and report a win
  # rate against their reference).
  kind = "sampled" if "eval/win_rate" in summary else "greedy"
  head = f"Gold reward of {kind} outputs on held-out prompts: "
  if before is None:
    return head + f"after {after:.4f}"
  return head + f"before {before:.4f} -> after {after:.4f}"


def _format(metrics: Dict[str, float]) -> str:
  return ", ".join(f"{k.split('/')[-1]} {console.fixed(v)}"
                   for k, v in sorted(metrics.items()))

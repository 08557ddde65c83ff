"""The training loop every algorithm shares.

It owns the mesh, the workdir (its lock, its config), checkpoints (save,
keep, verified resume), preemption (SIGTERM, SIGINT and SIGHUP save at the
next step boundary and exit; during the final evaluation, the first lets it
finish), lost processes of a multi-host run, the non-finite guard, metrics
and console progress. It drives a `jaxrlhf.algorithms.trainer.Trainer`
through `init_state()` (or a restore into `abstract_state` and
`state_shardings`), `train_batches(position)`, `train_step(state, batch)`,
`tokens_in(local_batch)`, `evaluate(state)` and `finish_training(state)`.
"""

import contextlib
import json
import os
import signal
from typing import Dict, Optional

from etils import epath
import jax
import ml_collections
import numpy as np

from jaxrlhf import algorithms
from jaxrlhf import console
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.data import file_sources
from jaxrlhf.data import pipeline
from jaxrlhf.models import lora
from jaxrlhf.rewards import host as host_rewards
from jaxrlhf.train import best as best_lib
from jaxrlhf.train import checkpointing
from jaxrlhf.train import files
from jaxrlhf.train import metrics as metrics_lib
from jaxrlhf.train import peers
from jaxrlhf.train import workdir as workdir_lib


class NonFiniteError(RuntimeError):
  """A step produced a non-finite loss or gradient."""


WorkdirError = workdir_lib.WorkdirError
WriteError = files.WriteError
# A host reward function failed on a row (`jaxrlhf.rewards.host`).
RewardFunctionError = host_rewards.RewardFunctionError
check_workdir = workdir_lib.check_workdir
write_run_config = workdir_lib.write_run_config
# The lock a run holds on its workdir (taken by `train`; a pipeline of runs
# holds its top directory's with `with workdir_lock(path):`).
workdir_lock = workdir_lib.WorkdirLock


class _StopNow(Exception):
  """A second signal during the final evaluation: stop it."""


class _StopFlag:
  """Set by SIGTERM/SIGINT/SIGHUP; the loop checks it between steps.

  During the final evaluation (`final_phase`) a first signal lets the
  evaluation finish (the checkpoint is saved already) and a second one
  stops it at once (on a single process: several must stop together).
  """

  def __init__(self):
    self.signal_name: Optional[str] = None
    self._previous = {}
    self._final_signals: Optional[int] = None
    self._interruptible = False

  def __enter__(self):
    # SIGHUP too: the launchers start runs over ssh, which a lost
    # connection hangs up.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: signals stay as they were
        pass
    return self

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    if self._final_signals is not None:
      self._final_signals += 1
      if (self._final_signals >= 2 and self._interruptible
          and jax.process_count() == 1):
        raise _StopNow()

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  @contextlib.contextmanager
  def final_evaluation(self):
    """The final evaluation: a second signal within it raises _StopNow."""
    if self._final_signals is None:
      self._final_signals = 0
    self._interruptible = True
    try:
      yield
    finally:
      self._interruptible = False

  @property
  def signalled_in_final_phase(self) -> bool:
    return bool(self._final_signals)

  def requested(self) -> bool:
    local = self.signal_name is not None
    if jax.process_count() == 1:
      return local
    # Every process must stop at the same step, or the collectives hang.
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.array([local], np.int32))
    self._signalled = [int(i) for i in np.flatnonzero(np.ravel(flags))]
    return bool(np.any(flags))

  def describe(self) -> str:
    """Who received what, for the line the run stops with."""
    if self.signal_name is not None:
      return f"Received {self.signal_name}"
    others = getattr(self, "_signalled", [])
    if others:
      return (f"Process {', '.join(map(str, others))} received a stop "
              "signal")
    return "Received a stop request"


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
  mesh = sharding.training_mesh(config, devices)
  sharding.sampler_mesh(config, devices)
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
    lock = workdir_lock(workdir)
    # A lost process stops this one in one line (and frees the lock).
    with peers.PeerWatch(config.train.lost_process_timeout_s,
                         on_lost=lock.release):
      with lock:
        return _run(config, workdir, trainer)


def _run(config, workdir, trainer) -> Dict[str, float]:
  run = _Run(config, workdir, trainer)
  try:
    with _StopFlag() as stop:
      return run.go(stop)
  except Exception:
    _wait_for_device_work()
    raise
  finally:
    run.close()


def _wait_for_device_work() -> None:
  """Waits for the computations a failing run left running, so that none
  outlives the failure. The step split around the host dispatches the
  rollout's scoring and scores on the host meanwhile (`host_split`): a
  reward function failing there left it running, and a process that exits
  while XLA computes can crash in the interpreter's shutdown (seen once
  under load: the error line, then SIGSEGV instead of exit status 1)."""
  try:
    jax.block_until_ready(jax.live_arrays())
  except Exception:  # pylint: disable=broad-except
    pass  # a computation that failed has ended too


class _Run:
  """One call of `train`: restore or start, train, evaluate, keep the best.

  Its phases are methods so that each says what it does: `start` (resume
  from the newest verified checkpoint or initialise, then the evaluation
  before training), `train_steps` (steps, metrics, checkpoints, periodic
  evaluations, signals), `finish` (the final evaluation and the best
  checkpoint's test)."""

  def __init__(self, config, workdir, trainer):
    self.config, self.workdir, self.trainer = config, workdir, trainer
    self.checkpointer = checkpointing.Checkpointer(
        os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep)
    self.best = best_lib.BestCheckpoint(config, workdir, trainer)
    self.logger = None
    self.summary: Dict[str, float] = {}

  def close(self):
    if self.logger is not None:
      self.logger.close()
    self.checkpointer.close()
    self.best.close()

  def go(self, stop: _StopFlag) -> Dict[str, float]:
    if self.config.eval.only:
      return self.evaluate_only()
    started = self.start(stop)
    if started is None:
      return self.summary
    state, step, batches, first_batch = started
    state, step = self.train_steps(stop, state, step, batches, first_batch)
    if step is None:  # stopped by a signal, its checkpoint saved
      return self.summary
    return self.finish(stop, state, step)

  def evaluate_only(self) -> Dict[str, float]:
    """config.eval.only: the newest checkpoint (a fresh workdir: the initial
    policy) evaluated and logged at its step; nothing trained or saved."""
    trainer = self.trainer
    restored = self.checkpointer.restore_latest(trainer.checkpoint_target())
    if restored:
      step, state, _ = restored
      state = trainer.with_base(state, lora.read_base_record(self.workdir))
    else:
      step, state = 0, trainer.init_state()
    self.logger = metrics_lib.MetricsLogger(
        self.workdir, resume_step=step if restored else None,
        config=self.config)
    metrics = trainer.evaluate(state)
    if metrics:
      self.logger.write(step, metrics)
    console.log(f"Evaluation only (step {step}; "
                f"{trainer.evaluation_description()}): "
                + (_format(metrics) or "nothing judges this policy"))
    self.summary.update(metrics)
    return self.summary

  def start(self, stop: _StopFlag):
    """(state, step, batches, first batch) to train from, or None when
    there is nothing to train (finished already, or stopped before the
    first step)."""
    config, trainer = self.config, self.trainer
    total = config.train.num_steps
    # (A LoRA run's checkpoints hold its adapters, not its frozen base.)
    restored = self.checkpointer.restore_latest(trainer.checkpoint_target())
    latest = restored[0] if restored else None
    # Refuses a resume that is not the run its checkpoints describe.
    changed = (workdir_lib.check_resumed_config(self.workdir, config, latest)
               if restored else None)
    # Rows logged after the checkpoint we resume from (a crash between
    # saves), or by a start that never saved, are dropped, so that
    # metrics.jsonl reads as one uninterrupted run.
    self.logger = metrics_lib.MetricsLogger(self.workdir, resume_step=latest,
                                            config=config)
    if restored:
      _, state, position = restored
      state = trainer.with_base(state, lora.read_base_record(self.workdir))
      self.summary.update(self.logger.eval_before())
      console.log(f"Resumed from checkpoint at step {latest} in "
                  f"{self.checkpointer.directory}")
      if changed:
        workdir_lib.keep_previous_config(self.workdir, latest)
        console.log(changed)
    else:
      state, position = trainer.init_state(), 0
      _record_base(self.workdir, trainer.base_record(state))
    step = int(jax.device_get(state.step))
    batches = trainer.train_batches(position)
    # The first batch is read now, so that bad data stops the run before
    # the first evaluation (which can take minutes) rather than after it.
    first_batch = next(batches) if step < total else None
    write_run_config(self.workdir, config)
    if latest is None:
      final = self.evaluate_before(state)
      if step < total and stop.requested():
        console.log(f"{stop.describe()} before the first step: nothing "
                    "to save. Run the same command again to start.")
        return None
    else:
      final = self.logger.eval_at(step)
    if step >= total and _all_processes_agree(bool(final) or latest is None):
      # A finished run: its final evaluation is in metrics.jsonl already.
      self.summary.update(final)
      console.log(f"Already at step {step} of {total}; nothing to train.")
      return None
    return state, step, batches, first_batch

  def evaluate_before(self, state) -> Dict[str, float]:
    """The evaluation of a new run at step 0, logged with the counts of
    rows skipped by data.files.on_bad_row=skip_and_report."""
    before = self.trainer.evaluate(state)
    first_row = dict(before, **_bad_row_metrics(self.config))
    if first_row:
      self.logger.write(0, first_row)
    if before:
      console.log(f"Before training "
                  f"({self.trainer.evaluation_description()}): "
                  + _format(before))
    self.summary.update({k.replace("eval/", "eval_before/"): v
                         for k, v in before.items()})
    return before

  def train_steps(self, stop: _StopFlag, state, step, batches, first_batch):
    """Steps to config.train.num_steps; (state, step) at the end, or (state,
    None) after a signal stopped the run (its checkpoint saved)."""
    config, trainer = self.config, self.trainer
    total = config.train.num_steps
    progress = metrics_lib.Progress(total)
    pending = _PendingMetrics(
        config, self.logger, progress, self.checkpointer,
        getattr(getattr(trainer, "model_config", None), "attention_impl",
                None))
    eval_every = config.eval.every_steps
    ckpt_every = config.checkpoint.every_steps
    first_step = True
    while step < total:
      if first_batch is None:
        local = next(batches)
      else:
        local, first_batch = first_batch, None
      batch = sharding.global_batch(local, trainer.mesh, trainer.rules)
      state, step_metrics = trainer.train_step(state, batch)
      step += 1
      if first_step:
        # It compiles the step: the rates and the ETA start after it.
        jax.block_until_ready(step_metrics)
        progress.first_step_done(step)
        first_step = False
      if step == total:
        # Before the final save, so the last checkpoint holds the result.
        state, final_metrics = trainer.finish_training(state)
        step_metrics = dict(step_metrics, **final_metrics)
      pending.add(step, step_metrics, trainer.tokens_in(local))
      stopping = stop.requested()
      save_now = stopping or step == total or (
          ckpt_every and step % ckpt_every == 0)
      if save_now or step % config.train.log_every == 0:
        pending.flush()
      if save_now:
        self.checkpointer.save(step, trainer.checkpointed(state),
                               batches.position)
      if stopping:
        console.log(
            f"{stop.describe()}: saved a checkpoint at step {step} and "
            "stopped. Run the same command again to resume.")
        return state, None
      if eval_every and step % eval_every == 0 and step < total:
        evaluated = trainer.evaluate(state)
        if evaluated:
          self.logger.write(step, evaluated)
          console.log(
              f"Evaluation (step {step}; "
              f"{trainer.evaluation_description()}): " + _format(evaluated))
        self.best.observe(step, evaluated, state)
    return state, step

  def finish(self, stop: _StopFlag, state, step) -> Dict[str, float]:
    """The final evaluation (the final checkpoint is saved: a signal now
    lets it finish, a second one stops it and a rerun evaluates), then the
    best checkpoint's test."""
    trainer = self.trainer
    try:
      with stop.final_evaluation():
        after = trainer.evaluate(state)
    except _StopNow:
      console.log(
          f"Received {stop.signal_name} twice during the final evaluation: "
          f"stopped it. The checkpoint at step {step} is saved; run the "
          "same command again to evaluate it.")
      return self.summary
    if after:
      self.logger.write(step, after)
      console.log(f"After training (step {step}; "
                  f"{trainer.evaluation_description()}): " + _format(after))
    self.summary.update(after)
    self.best.observe(step, after, state)
    self.summary.update(self.best.finish(state, step, self.logger))
    if stop.signalled_in_final_phase:
      console.log(f"Received {stop.signal_name} during the final "
                  "evaluation: finished it first; the run is complete.")
    return self.summary


class _PendingMetrics:
  """Step metrics kept on the device until the next log or save, so that
  steps are not stalled by a device-to-host copy each."""

  def __init__(self, config, logger, progress, checkpointer,
               attention_impl=None):
    self._config, self._logger = config, logger
    self._attention_impl = attention_impl
    self._progress, self._checkpointer = progress, checkpointer
    self._rows = []  # (step, device metrics, tokens)

  def add(self, step, metrics, tokens):
    self._rows.append((step, metrics, tokens))

  def flush(self):
    """Writes the buffered metrics; raises at the first non-finite step."""
    host = jax.device_get([(s, m) for s, m, _ in self._rows])
    tokens = sum(t for s, _, t in self._rows if self._progress.timed(s))
    for s, m in host:
      if m.get("nonfinite", 0.0) > 0:
        raise NonFiniteError(_nonfinite_message(
            self._config, s, m, self._checkpointer.latest_step(),
            self._attention_impl))
      self._logger.write(s, {k: v for k, v in m.items()
                             if k != "nonfinite" and not _no_value(k, v)})
    if host:
      s, m = host[-1]
      console.log(self._progress.line(s, m["loss"], tokens))
    self._rows.clear()


def _no_value(name: str, value) -> bool:
  """A reward's mean over the rows it applies to, in a step where it
  applied to none (its `reward/<name>/rows` is 0): NaN by design, and left
  out of the logs rather than written as a number."""
  return name.startswith("reward/") and bool(np.isnan(value))


def _record_base(workdir: str, record) -> None:
  """Writes what names a new LoRA run's base into the workdir (process 0):
  its checkpoints hold only the adapters."""
  if record is None or jax.process_index() != 0:
    return
  files.write_atomically(
      epath.Path(workdir) / lora.BASE_RECORD,
      json.dumps(record, indent=1, sort_keys=True) + "\n")


def _nonfinite_message(config, step: int, metrics, last_saved,
                       attention_impl=None) -> str:
  """Which step, what was kept, and what to change to go on.
  `attention_impl`: the kernel the model runs (config.model's 'auto'
  resolved), where known."""
  clip = config.optimizer.grad_clip_norm
  if last_saved is None:
    kept = ("no checkpoint had been saved yet, so running again starts "
            "over")
    again = "run the same command again"
  else:
    kept = f"the last good checkpoint (step {last_saved}) is untouched"
    again = f"run the same command again to resume from step {last_saved}"
  if clip > 0:
    advice = (f"Lower optimizer.learning_rate (or optimizer.grad_clip_norm, "
              f"now {clip:g}) and {again}")
  else:
    advice = (f"Lower optimizer.learning_rate and {again}, or set "
              "optimizer.grad_clip_norm in a fresh --workdir")
  if (attention_impl or config.model.get("attention_impl")
      ) == "dot_product_cudnn":
    advice += (". With cuDNN's attention (model.attention_impl="
               f"{config.model.get('attention_impl')!r}) on a "
               "Hopper GPU or later, a row whose attention mask has padding "
               "between real tokens also gives NaN "
               "(`fused_attention.cudnn_unpacked`): pad rows on the left or "
               "right only, or use attention_impl='dot_product'")
  return (f"Step {step} produced a non-finite loss or gradient "
          f"(loss={metrics['loss']}, grad_norm={metrics['grad_norm']}). The "
          f"run stopped without saving; {kept}. {advice}.")


def _bad_row_metrics(config) -> Dict[str, float]:
  """Counts of the data files' skipped rows, by split and reason."""
  if not config.data.files.train:
    return {}
  source = getattr(pipeline.get_task(config.data.task), "source", None)
  if not isinstance(source, file_sources.AlignmentFileSource):
    return {}
  return source.bad_row_metrics()


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

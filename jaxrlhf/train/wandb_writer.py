"""Weights & Biases as one more clu metric writer (config.train.wandb).

Optional: `pip install -e .[wandb]`. The run's metrics logger
(`metrics.MetricsLogger`) writes each row of scalars to TensorBoard,
metrics.jsonl and, with this writer, wandb, from the one process that
writes metrics.

Each row is one wandb history row holding the run's step as the scalar
"step", which every other scalar is plotted against (`define_metric`):
wandb's own step must only grow, and a run writes an evaluation at step N
before the buffered train rows of the steps before it, which wandb would
drop.
"""

import os
from typing import Any, Mapping, Optional

from clu import metric_writers
from etils import epath

from jaxrlhf.train import files

# The scalar that holds the training step in each history row.
STEP = "step"


class WandbWriter(metric_writers.MetricWriter):
  """Writes scalars to a wandb run (the run's config is recorded by
  `create`); the other kinds jaxrlhf does not log, and they are refused
  rather than dropped."""

  def __init__(self, run):
    self._run = run

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    self._run.log({STEP: int(step), **{k: float(v)
                                       for k, v in scalars.items()}})

  def _unsupported(self, *args, **kwargs):
    del args, kwargs
    raise NotImplementedError("WandbWriter writes scalars only.")

  write_summaries = write_images = write_videos = _unsupported
  write_audios = write_texts = write_histograms = _unsupported
  write_hparams = _unsupported

  def flush(self):
    pass  # wandb's service process writes (and uploads) as rows arrive

  def close(self):
    self._run.finish()


def create(config, workdir: str) -> Optional[WandbWriter]:
  """The wandb writer of a run (call it on the process that writes
  metrics), or None with config.train.wandb off.

  The wandb run is named after the workdir's last directory, records the
  run's config, and keeps its files under `<workdir>/wandb/` (a local
  workdir; else where wandb puts them) unless WANDB_DIR says otherwise. A
  resumed run is a new wandb run of the same name, from the step it
  resumes at."""
  train = config.train
  if not train.wandb:
    return None
  # (defaults.validate refused a run with the package missing.)
  import wandb  # pylint: disable=g-import-not-at-top
  workdir = epath.Path(workdir)
  directory = None
  if not os.environ.get("WANDB_DIR") and not files.is_remote(workdir):
    directory = str(workdir)
  try:
    run = wandb.init(
        project=train.wandb_project, entity=train.wandb_entity or None,
        mode=train.wandb_mode, name=workdir.name, job_type=config.algorithm,
        config=dict(config.to_dict(), workdir=str(workdir)), dir=directory,
        # Its banners and links are not the run's output; and the console
        # stays ours (no stdout capture).
        settings=wandb.Settings(silent=True, console="off"))
  except Exception as e:  # pylint: disable=broad-except
    lines = str(e).strip().splitlines()
    raise RuntimeError(
        f"config.train.wandb: wandb.init failed ({type(e).__name__}: "
        f"{lines[0] if lines else ''}). Log in (`wandb login` or "
        "WANDB_API_KEY), or set --config.train.wandb_mode=offline "
        "(`wandb sync` uploads it later).") from None
  run.define_metric(STEP)
  run.define_metric("*", step_metric=STEP)
  return WandbWriter(run)

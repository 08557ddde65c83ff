"""The best checkpoint by an evaluation metric, kept besides the latest.

The DRO paper records a checkpoint every 2,000 steps and represents each
run by the one that wins most often against the SFT policy, side by side
(section 4). With `config.checkpoint.best_metric` set (e.g.
"eval/win_rate") every evaluation after a train step is a candidate: when
its value beats the best so far (`checkpoint.best_mode` "max" or "min"),
the trained networks are saved to

  <workdir>/best/checkpoints/<step>/     (`params`: every trained network)
  <workdir>/best/best.json               step, metric, value, the evaluation
  <workdir>/best/config.json             the run's config

so `<workdir>/best` is itself a checkpoint other runs load
(`--config.init.policy_checkpoint=<workdir>/best`, `from_pretrained`). A
resumed run reads best.json and keeps competing against it.

Reporting on other prompts than the ones the checkpoint was chosen on:
with `config.eval.test_split` set, the chosen checkpoint's policy (the final
one without `best_metric`) is judged once more after training on that split
of eval.task (the DRO paper's 5 folds of 1,000 test prompts), logged as
`test/...` rows at the last step and added to best.json.

The training loop calls `observe` after each evaluation and `finish` at the
end; the rest is here.
"""

import json
import math
from typing import Dict, Optional

from etils import epath
import jax

from jaxrlhf import console
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms import state as state_lib
from jaxrlhf.train import checkpointing
from jaxrlhf.train import files

DIRECTORY = "best"
SUMMARY = "best.json"


class BestCheckpoint:
  """Keeps `<workdir>/best` (module docstring) for one run."""

  def __init__(self, config, workdir: str, trainer):
    self._metric = config.checkpoint.best_metric
    self._sign = 1.0 if config.checkpoint.best_mode == "max" else -1.0
    self._test_split = config.eval.test_split
    self._trainer = trainer
    self._config = config
    self._directory = epath.Path(workdir) / DIRECTORY
    self._checkpointer = None
    self.best: Optional[dict] = self._read()

  @property
  def enabled(self) -> bool:
    return bool(self._metric)

  def _read(self) -> Optional[dict]:
    path = self._directory / SUMMARY
    if not self._metric or not path.exists():
      return None
    return json.loads(path.read_text())

  def _write(self, name: str, text: str) -> None:
    """Writes `<workdir>/best/<name>` atomically (process 0; a full disk is
    a one-line error, `files.write_atomically`)."""
    if jax.process_index() != 0:
      return
    self._directory.mkdir(parents=True, exist_ok=True)
    files.write_atomically(self._directory / name, text)

  def _manager(self) -> checkpointing.Checkpointer:
    if self._checkpointer is None:
      self._checkpointer = checkpointing.Checkpointer(
          str(self._directory / "checkpoints"), keep=1)
    return self._checkpointer

  def observe(self, step: int, metrics: Dict[str, float], state) -> None:
    """After the evaluation of train step `step`: saves the state's trained
    networks if `metrics` beats the best so far."""
    if not self.enabled or step == 0 or self._metric not in metrics:
      return
    value = float(metrics[self._metric])
    if not math.isfinite(value):
      return
    if self.best is not None and (
        self._sign * value <= self._sign * self.best["value"]):
      return
    self._manager().save(step, {"params": state.params}, 0)
    self.best = {"step": step, "metric": self._metric, "value": value,
                 "evaluation": {k: float(v) for k, v in metrics.items()}}
    self._write(SUMMARY, json.dumps(self.best, indent=2, sort_keys=True))
    self._write("config.json",
                self._config.to_json_best_effort(indent=2, sort_keys=True))
    console.log(f"Best checkpoint so far: step {step} ({self._metric} "
                f"{console.fixed(value)}), saved in {self._directory}")

  def _best_params(self, state):
    """The trained networks of the best checkpoint, restored into the
    state's shardings."""
    trainer = self._trainer
    abstract = {"params": state_lib.abstract_with_shardings(
        trainer.abstract_state.params, trainer.state_shardings.params)}
    restored, _ = self._manager().restore(self.best["step"], abstract)
    return restored["params"]

  def finish(self, state, step: int, logger) -> Dict[str, float]:
    """After the final evaluation: judges the chosen policy on
    config.eval.test_split, logs the `test/...` metrics at `step` and
    returns them ({} when there is no test split)."""
    try:
      if not self._test_split or not self._trainer.algorithm.networks.reference:
        return {}
      chosen_step = step
      if self.enabled and self.best is not None:
        chosen_step = self.best["step"]
        if chosen_step != step:
          state = state.replace(params=self._best_params(state))
      metrics = policy_eval.against_reference(self._trainer, state,
                                              split=self._test_split)
      metrics = {"test/" + k.split("/", 1)[1]: v for k, v in metrics.items()}
      metrics["test/step"] = float(chosen_step)
      if metrics:
        logger.write(step, metrics)
        console.log(
            f"Test split {self._test_split!r} (the policy of step "
            f"{chosen_step}): " + ", ".join(
                f"{k.split('/')[-1]} {console.fixed(v)}"
                for k, v in sorted(metrics.items()) if k != "test/step"))
        if self.enabled and self.best is not None:
          self._write(SUMMARY, json.dumps(dict(self.best, test=metrics),
                                          indent=2, sort_keys=True))
      return metrics
    finally:
      self.close()

  def close(self) -> None:
    if self._checkpointer is not None:
      self._checkpointer.close()
      self._checkpointer = None


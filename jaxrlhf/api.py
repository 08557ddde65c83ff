"""A run driven step by step from Python: a notebook, or a script of your own.

  from jaxrlhf import api, defaults

  config = defaults.load_config_file("configs/quickstart.py")
  config.pipeline.stages = ""                  # one algorithm, not a pipeline
  run = api.Run(config, evaluate=False)        # mesh, model, data, the step
  state = run.init()                           # a new run's state
  for batch in itertools.islice(run.batches(), 100):
    state, metrics = run.step(state, batch)    # metrics as Python floats
  run.sample(state, ["summarize: fox owl fox"])  # completions, as text
  state, step = run.restore("/tmp/other_run")  # a workdir's newest checkpoint

`api.Run(config)` is what `jaxrlhf.train.loop.train(config, workdir)` runs
on, without the loop: the config is validated as the command line
validates it, the mesh is `config.mesh` over all devices (or `devices`),
and every call enters that mesh and the config's logical-axis rules itself,
so a notebook never has to. A batch is this process's share of a global
batch: a dict of numpy arrays in the layout `run.batches()` gives (for
online algorithms, prompts), or your own in that layout
(`run.batch_spec()` says the global shapes). `loop.train(config, workdir)`
is the whole run as the command line runs it: checkpoints, metrics files,
evaluations, signals.
"""

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from etils import epath
import flax.linen as nn
import jax
import numpy as np

from jaxrlhf import algorithms
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.eval import evaluation
from jaxrlhf.models import lora
from jaxrlhf.train import checkpointing


class Run:
  """A run's trainer, ready to step (module docstring).

  Attributes:
    config: the validated config.
    mesh, rules: the device mesh and the logical-axis rules.
    trainer: the `jaxrlhf.algorithms.trainer.Trainer` (its model, vocabulary
      and jitted step), for what this class does not wrap.
  """

  def __init__(self, config, workdir: Optional[str] = None, *,
               evaluate: bool = True, devices=None):
    """Builds the run of `config`.

    Args:
      config: a config of `jaxrlhf.defaults` (its `algorithm` is the one
        that trains).
      workdir: where files beside the checkpoints go (precomputed
        reference log-probs); None if none are needed.
      evaluate: False skips evaluation (`evaluate` returns {}), and with it
        everything evaluation reads (held-out prompts, a judge).
      devices: the mesh's devices (default: all).
    """
    defaults.validate(config)
    self.config = config
    self.mesh = sharding.training_mesh(config, devices)
    self.rules = sharding.as_rules(config.sharding.logical_axis_rules)
    with self._active():
      self.trainer = algorithms.build(config, self.mesh, workdir,
                                      evaluate=evaluate)

  @contextlib.contextmanager
  def _active(self):
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def init(self):
    """A new run's train state: the checkpoints its networks start from
    (`config.init.policy_checkpoint`, ...), the rest initialised."""
    with self._active():
      return self.trainer.init_state()

  def restore(self, workdir: str, step: Optional[int] = None
              ) -> Tuple[object, int]:
    """(state, step) of the newest checkpoint of `workdir` that verifies,
    or of `step`; the workdir's run must have this run's state structure
    (the same algorithm, model and optimizer). A damaged newer step is
    moved aside, as a resumed run would."""
    directory = epath.Path(workdir) / "checkpoints"
    if not directory.exists():
      raise ValueError(f"{workdir} has no checkpoints to restore.")
    # (A LoRA run's checkpoints hold its adapters; its base is loaded.)
    abstract = self.trainer.checkpoint_target()
    # keep: nothing is saved or pruned here (a damaged newer step is moved
    # aside, as a resumed run does).
    checkpointer = checkpointing.Checkpointer(str(directory), keep=1)
    try:
      with self._active():
        if step is None:
          restored = checkpointer.restore_latest(abstract)
          if restored is None:
            raise ValueError(f"{workdir} has no checkpoint to restore.")
          step, state, _ = restored
        else:
          state, _ = checkpointer.restore(step, abstract)
        state = self.trainer.with_base(state, lora.read_base_record(workdir))
    finally:
      checkpointer.close()
    return state, step

  def batches(self, position: int = 0) -> Iterator[Dict[str, np.ndarray]]:
    """This process's share of the training batches from batch `position`
    on, as the run reads them."""
    return self.trainer.train_batches(position)

  def batch_spec(self) -> Dict[str, jax.ShapeDtypeStruct]:
    """The global shape and dtype of each feature of a training batch."""
    return self.trainer.batch_spec()

  def step(self, state, local_batch: Dict[str, np.ndarray]
           ) -> Tuple[object, Dict[str, float]]:
    """One train step on this process's share of a batch: (the new state,
    its metrics as floats). The state passed in is donated (its buffers are
    reused): keep using the one returned."""
    with self._active():
      batch = sharding.global_batch(local_batch, self.mesh, self.rules)
      state, metrics = self.trainer.train_step(state, batch)
      return state, {k: float(v) for k, v in jax.device_get(metrics).items()}

  def evaluate(self, state) -> Dict[str, float]:
    """The algorithm's evaluation ("eval/..." metrics), as the loop runs it
    before, during and after training; {} with evaluate=False."""
    with self._active():
      return dict(self.trainer.evaluate(state))

  def sample(self, state, prompts: Sequence[str], *, greedy: bool = False,
             temperature: float = 1.0, seed: int = 0) -> List[str]:
    """Completions of the policy in `state` for prompt texts (tokenized with
    the run's vocabulary, with the EOS its tasks append; at most
    `config.data.inputs_length` tokens as the model reads them), as text up
    to their EOS. At most `config.data.targets_length` tokens each."""
    trainer = self.trainer
    vocabulary = trainer.vocabulary
    rows = [list(vocabulary.encode(p)) + [vocabulary.eos_id]
            for p in prompts]
    width = trainer.prompt_length
    tokens = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
      if len(row) > width:
        raise ValueError(
            f"prompt {i} ({prompts[i][:40]!r}...) has {len(row)} tokens with "
            f"its EOS, more than config.data.inputs_length allows "
            f"({width}); shorten it or raise the length.")
      tokens[i, :len(row)] = row
    with self._active():
      samples = evaluation.sample(trainer, trainer.view(state).params["policy"],
                                  tokens,
                                  greedy=greedy, temperature=temperature,
                                  seed=seed)
    return evaluation.completion_texts(vocabulary, samples)

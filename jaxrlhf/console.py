"""What a run prints: our own lines on process 0, and no library noise.

Every line a user sees should be ours and mean something. The libraries under
us print a good deal that a user would read as a problem: TensorFlow's C++
start-up lines (CUDA probing on a machine without a GPU, written through absl
before any log setting applies, and an error-level "failed call to cuInit"),
SentencePiece's INFO line each time a model without a normaliser table is
loaded, and absl warnings of seqio and orbax about choices we made on
purpose. `silence_library_noise()` turns those off; importing `jaxrlhf` runs
it, and the command line also raises the Python loggers.

TensorFlow is not imported until something needs it (seqio, the data
pipelines and so the config's defaults do; the models, the samplers and
`--help` do not, and start several seconds sooner): `silence_library_noise`
leaves a hook on the import system that holds TensorFlow's start-up lines
back whenever that first import happens.
"""

import contextlib
import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import tempfile

_QUIET_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "3"}
_silenced = False


@contextlib.contextmanager
def _stderr_held_back():
  """Holds back what C and C++ code write to file descriptor 2; replays it
  only if the block raises (so a failing import still explains itself)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      held.seek(0)
      sys.stderr.write(held.read().decode(errors="replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
  """Finds `tensorflow` when it is first imported and executes it (with
  tensorflow_text, as the data pipelines want both) with the C++ start-up
  lines held back, then hides the GPUs from it: TensorFlow only reads data
  on the host here, and must not take accelerator memory that JAX needs.
  Removes itself from the import system at that first import."""

  def find_spec(self, fullname, path, target=None):
    del path, target
    if fullname != "tensorflow":
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


class _QuietLoader(importlib.abc.Loader):
  """TensorFlow's own loader, executing the module as the class above
  says; every other attribute is the wrapped loader's."""

  def __init__(self, loader):
    self._loader = loader

  def __getattr__(self, name):
    return getattr(self._loader, name)

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    with _stderr_held_back():
      self._loader.exec_module(module)
      try:
        importlib.import_module("tensorflow_text")
      except ImportError:
        pass
      # Hiding the GPUs probes CUDA, which logs an error on a machine
      # without one (seen when JAX was imported before us).
      module.config.set_visible_devices([], "GPU")


def silence_library_noise(python_loggers: bool = False) -> None:
  """Turns off the libraries' start-up and per-call log lines.

  TensorFlow's start-up lines are held back when it is first imported,
  whenever that happens (`_QuietTensorFlowImport`); without TensorFlow
  installed, nothing needs it (the models and samplers run on JAX alone,
  e.g. a benchmark on a machine with just JAX).

  Args:
    python_loggers: also raise the Python (absl) loggers to ERROR, so that
      seqio's, orbax's and TensorFlow's warnings about settings we chose on
      purpose are not printed; the command line does this, a notebook keeps
      its own logging settings.
  """
  global _silenced
  if not _silenced:
    _silenced = True
    for key, value in _QUIET_ENVIRONMENT.items():
      os.environ.setdefault(key, value)
    if "tensorflow" not in sys.modules:
      sys.meta_path.insert(0, _QuietTensorFlowImport())
    import sentencepiece  # pylint: disable=g-import-not-at-top
    # 1 = WARNING: hides "precompiled_charsmap is empty" per model load.
    sentencepiece.set_min_log_level(1)
  if python_loggers:
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    absl_logging.set_verbosity(absl_logging.ERROR)
    for name in ("tensorflow", "jax", "orbax", "absl"):
      logging.getLogger(name).setLevel(logging.ERROR)


def fixed(value: float, digits: int = 4) -> str:
  """`value` with `digits` decimals, never "-0.0000": a value that rounds to
  zero prints as zero whatever its sign."""
  rounded = round(float(value), digits)
  return f"{rounded + 0.0:.{digits}f}"


def log(message: str) -> None:
  """Prints `message` once per run: on process 0 only."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0:
    print(message, flush=True)

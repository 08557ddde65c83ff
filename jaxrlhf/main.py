r"""Command-line entry point.

  python -m jaxrlhf.main --config=configs/quickstart.py --workdir=/tmp/run \
      --config.train.num_steps=1000

`--config` takes a config file (optionally `file.py:arg`) whose
`get_config()` returns an ml_collections ConfigDict; any field can be
overridden with `--config.a.b=value`. Running the same command again resumes
from the latest checkpoint in the workdir.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (path[:arg]).", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics and the resolved config.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # Imported here so that --help and flag errors are fast.
  import jax
  from jaxrlhf.train import loop

  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/quickstart.py")
  try:
    summary = loop.train(config, _WORKDIR.value)
  except (ValueError, loop.NonFiniteError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  if jax.process_index() == 0 and "eval/gold_reward" in summary:
    before = summary.get("eval_before/gold_reward")
    after = summary["eval/gold_reward"]
    line = f"Gold reward of greedy outputs on held-out prompts: after {after:.4f}"
    if before is not None:
      line = (f"Gold reward of greedy outputs on held-out prompts: "
              f"before {before:.4f} -> after {after:.4f}")
    print(line, flush=True)


def run():
  app.run(main)


if __name__ == "__main__":
  run()

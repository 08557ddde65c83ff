"""What a config file under `configs/` reads besides `defaults.base_config()`:
the placeholder it puts where a user's own path goes, and `load_config_file`,
for a config built on another's.

Standard library only: the command line runs a config file before it imports
the library, to check its overrides (`jaxrlhf.cli.early_unknown_field`), and
gives it these through its stand-in for `jaxrlhf.defaults`, whose names they
also are (`defaults.PLACEHOLDER`, `defaults.load_config_file`).
"""

import importlib.util
import os
from typing import Optional

# What the paper configs put where a user's own path goes
# (`defaults.check_paths` refuses it with the field to point at a copy).
PLACEHOLDER = "YOUR_BUCKET"


def load_config_file(path, arg: Optional[str] = None):
  """`get_config(arg)` of a config file such as configs/quickstart.py, as
  `--config=path[:arg]` would give it, for scripts, notebooks and config
  files built on another; an `ml_collections.ConfigDict`."""
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)

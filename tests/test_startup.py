"""What runs before a run reads data does not load the data stack.

A config is loaded and validated, `--help` printed and a config error
reported without TensorFlow or seqio (most of the start-up time: a typo in
a config field took 5.8 CPU seconds with them, 1.5 without); they load where
a run first reads data (`jaxrlhf.algorithms.trainer.Trainer`, `train.loop`).

Each check runs in a fresh interpreter (this one has loaded everything), one
for the in-process checks together and one for the command line's exit.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from conftest import REPO

HEAVY = ("tensorflow", "seqio", "tensorflow_datasets")
CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.py"))


def run_python(code: str, *args: str):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                        cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)


def test_configs_help_and_docs_load_no_data_stack():
  """In one interpreter: `python -m jaxrlhf.main --help`; every committed
  config parsed by main's own --config flag and validated as the run's
  preflight does before a trainer is built (its fields, groups and the
  algorithm's checks, and its batch splits on one data shard); the docs'
  --help and rendering."""
  result = run_python(f"""
      import contextlib, io, json, runpy, sys
      out = {{}}
      # `python -m jaxrlhf.main --help`, in this interpreter.
      sys.argv = ["jaxrlhf.main", "--help"]
      text = io.StringIO()
      with contextlib.redirect_stdout(text):
        try:
          runpy.run_module("jaxrlhf.main", run_name="__main__")
        except SystemExit as e:
          out["main_help_exit"] = e.code
      out["main_help"] = text.getvalue()
      from absl import flags
      from jaxrlhf import algorithms, cli, defaults, docs
      out["validated"] = []
      for path in {CONFIGS!r}:
        flags.FLAGS(["jaxrlhf.main", "--config=" + path])
        config = cli.loaded_config()
        defaults.validate(config)
        algorithms.check_rows(config, data_parallel=1)
        out["validated"].append((path, config.algorithm))
      with contextlib.redirect_stdout(io.StringIO()) as text:
        out["docs_help_exit"] = docs.main(["jaxrlhf.docs", "--help"])
      out["docs_help"] = text.getvalue()
      out["docs"] = docs.render()
      out["algorithms"] = list(algorithms.NAMES)
      out["loaded"] = [m for m in {HEAVY!r} if m in sys.modules]
      print(json.dumps(out))
      """)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.splitlines()[-1])
  assert out["main_help_exit"] == 0
  assert "--workdir" in out["main_help"] and "--config" in out["main_help"]
  assert [p for p, _ in out["validated"]] == CONFIGS
  # Each config's algorithm is a registered one (the registry loaded).
  assert all(a in out["algorithms"] for _, a in out["validated"])
  assert out["docs_help_exit"] == 0 and "--check" in out["docs_help"]
  assert all(f"| `{a}` |" in out["docs"] for a in out["algorithms"])
  assert out["loaded"] == []


def test_config_typo_is_one_line_without_the_data_stack(tmp_path):
  """`python -m jaxrlhf.main --config=configs/quickstart.py
  --config.train.num_stepz=3`: exit status 2, one line naming the field;
  the modules loaded by then are written at exit (atexit runs on
  sys.exit), so stderr holds only the error."""
  probe = tmp_path / "loaded.json"
  result = run_python(f"""
      import atexit, json, runpy, sys
      atexit.register(lambda: open({str(probe)!r}, "w").write(json.dumps(
          [m for m in {HEAVY!r} if m in sys.modules])))
      sys.argv = ["jaxrlhf.main"] + sys.argv[1:]
      runpy.run_module("jaxrlhf.main", run_name="__main__")
      """, "--config=configs/quickstart.py", "--config.train.num_stepz=3")
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
  assert "train.num_stepz" in lines[0] and "num_steps" in lines[0]
  assert json.loads(pathlib.Path(probe).read_text()) == []

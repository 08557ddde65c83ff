"""What runs before a run reads data does not load the data stack.

A config is loaded and validated, `--help` printed and a config error
reported without TensorFlow or seqio (most of the start-up time: a typo in
a config field took 5.8 CPU seconds with them, 1.5 without); they load where
a run first reads data (`jaxrlhf.algorithms.trainer.Trainer`, `train.loop`).
An override naming a missing field is refused without even JAX when the
config file needs no more of the library than `defaults.base_config()` and
modules that import nothing outside the standard library, as every
committed config does (checked against the generated index,
`jaxrlhf/config_index.py`): 0.18-0.20 CPU seconds instead of 1.99-2.03 on 2
quiet cores for configs/quickstart.py; 0.18-0.24 for each committed config
(3 runs each, 2 cores at a load of 9), where those importing
`jaxrlhf.presets` took about 2 before.
An ahead-of-time plan (`python -m jaxrlhf.plan`) reads no data and loads
neither: its trainer takes the vocabulary's size and the batch layout from
the config (`jaxrlhf.data.shapes`).

Each check runs in a fresh interpreter (this one has loaded everything): one
for the in-process checks together, one for the command line's exit, two
for plans (the command, and plans of the other layouts in-process), and two
for the early check of overrides (without the library, and the full parse
it must agree with).
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, TINY_OVERRIDES, cli_args

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


@pytest.mark.parametrize("config", CONFIGS)
def test_config_typo_is_one_line_without_the_data_stack(tmp_path, config):
  """`python -m jaxrlhf.main --config=<committed config>
  --config.train.num_stepz=3`: exit status 2, one line naming the field,
  found before JAX is imported; the modules loaded by then are written at
  exit (atexit runs on sys.exit), so stderr holds only the error."""
  probe = tmp_path / "loaded.json"
  result = run_python(f"""
      import atexit, json, runpy, sys
      atexit.register(lambda: open({str(probe)!r}, "w").write(json.dumps(
          [m for m in {HEAVY + ("jax",)!r} if m in sys.modules])))
      sys.argv = ["jaxrlhf.main"] + sys.argv[1:]
      runpy.run_module("jaxrlhf.main", run_name="__main__")
      """, f"--config={config}", "--config.train.num_stepz=3")
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
  assert "train.num_stepz" in lines[0] and "num_steps" in lines[0]
  assert json.loads(pathlib.Path(probe).read_text()) == []


def test_a_plan_loads_no_data_stack(tmp_path):
  """`python -m jaxrlhf.plan --config=configs/quickstart.py --topology=cpu:2`
  (test_plan's command, the same figures): exit status 0, its plan printed
  and written, and neither TensorFlow nor seqio loaded by its exit."""
  probe, out = tmp_path / "loaded.json", tmp_path / "plan.json"
  result = run_python(f"""
      import atexit, json, runpy, sys
      atexit.register(lambda: open({str(probe)!r}, "w").write(json.dumps(
          [m for m in {HEAVY!r} if m in sys.modules])))
      sys.argv = ["jaxrlhf.plan"] + sys.argv[1:]
      runpy.run_module("jaxrlhf.plan", run_name="__main__")
      """, "--config=configs/quickstart.py", "--topology=cpu:2",
      f"--out={out}", *cli_args(mesh__shape="(2,1)"))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("Plan: sft on t5 tiny")
  plan = json.loads(out.read_text())
  # 16 rows of data.targets_length target tokens, laid out without seqio.
  assert plan["tokens_per_step"] == 16 * 16
  assert json.loads(pathlib.Path(probe).read_text()) == []


# Plans of the other layouts a shapes-only trainer derives: decoder-only
# preference pairs from a file (never read) packed 2 per row, K-wise
# rankings, and an online step on a built-in task (its vocabulary's size
# counted from the task's word list).
PLANNED = {
    "dpo-llama-packed": {"algorithm": "dpo", "model.arch": "llama",
                         "model.size": "tiny", "data.pack": 2,
                         "model.num_encoder_layers": None,
                         "data.task": "startup_pairs",
                         "data.files.train": "/nonexistent/pairs_*.jsonl"},
    "ranking-t5": {"algorithm": "reward_model_ranking",
                   "data.task": "startup_ranking",
                   "data.files.train": "/nonexistent/ranking_*.jsonl"},
    "grpo-t5": {"algorithm": "grpo", "rewards.reward_model.weight": 0.0,
                "rewards.gold_reward.weight": 1.0,
                "online.samples_per_prompt": 2, "online.max_new_tokens": 4,
                "data.task": "synthetic_arithmetic"},
}


def test_plans_of_every_layout_load_no_data_stack():
  """In one interpreter on one CPU device: `plan.make_plan` of the layouts
  in PLANNED (each tiny), each with its batch laid out and its step
  compiled; neither TensorFlow nor seqio loaded."""
  result = run_python(f"""
      import json, sys
      from jaxrlhf import plan as plan_lib
      plan_lib.prepare_platform("cpu:1")
      from jaxrlhf import defaults
      out = {{}}
      for name, overrides in {PLANNED!r}.items():
        config = defaults.load_config_file("configs/quickstart.py")
        defaults.apply_overrides(config, dict({TINY_OVERRIDES!r},
                                              **overrides))
        plan = plan_lib.make_plan(config, plan_lib.topology_devices("cpu:1"),
                                  topology="cpu:1")
        out[name] = (plan["algorithm"], plan["tokens_per_step"])
      out["loaded"] = [m for m in {HEAVY!r} if m in sys.modules]
      print(json.dumps(out))
      """)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.splitlines()[-1])
  assert out.pop("loaded") == []
  assert {name: algorithm for name, (algorithm, _) in out.items()} == {
      name: overrides["algorithm"] for name, overrides in PLANNED.items()}


# Config files that change the fields base_config() gives them, for
# test_early_check_agrees_with_the_full_parse.
CHANGING_CONFIGS = {
    # Adds a field to a group, and a group holding a dict.
    "adds.py": """
        from jaxrlhf import defaults
        def get_config():
          c = defaults.base_config()
          c.train.num_stepz = 1
          c.model.family_dict = {"rope_theta": 1.0}
          return c
        """,
    # Imports JAX (and sets nothing of it).
    "jax.py": """
        import jax
        from jaxrlhf import defaults
        def get_config():
          return defaults.base_config()
        """,
    # Removes a field.
    "removes.py": """
        from jaxrlhf import defaults
        def get_config():
          c = defaults.base_config()
          del c.train.num_steps
          return c
        """,
    # Adds a field only when given an argument (`arg.py:extra`).
    "arg.py": """
        from jaxrlhf import defaults
        def get_config(extra=""):
          c = defaults.base_config()
          if extra:
            c.train[extra] = 1
          return c
        """,
    # Adds a field only if a module of the library that needs JAX imports,
    # hiding any failure to import it.
    "hides.py": """
        from jaxrlhf import defaults
        def get_config():
          c = defaults.base_config()
          try:
            from jaxrlhf import sharding
            c.train.num_stepz = 1
          except BaseException:
            pass
          return c
        """,
}

# (config, override, whether the full parse accepts it, whether the early
# check refuses it itself).
CASES = [
    ("configs/quickstart.py", "train.num_stepz=3", False, True),
    ("configs/quickstart.py:small", "trian.num_steps=3", False, True),
    # Below a field that holds a number.
    ("configs/quickstart.py", "train.num_steps.per_hostz=3", False, True),
    # A name the library's source quotes, as it would a field declared
    # since the index was generated: the full parse decides.
    ("configs/quickstart.py", "train.arch=t5", False, False),
    # A config file that imports JAX: the full parse decides.
    ("jax.py", "train.num_stepz=3", False, False),
    ("adds.py", "train.num_stepz=3", True, False),
    ("adds.py", "model.family_dict.rope_theta=2.0", True, False),
    ("adds.py", "model.family_dict.rope_thetaa=2.0", False, True),
    ("removes.py", "train.num_steps=3", False, False),
    ("arg.py:num_stepz", "train.num_stepz=3", True, False),
    ("arg.py", "train.num_stepz=3", False, True),
    ("hides.py", "train.num_stepz=3", True, False),
] + [(config, "train.num_stepz=3", False, True) for config in CONFIGS]


def test_early_check_agrees_with_the_full_parse(tmp_path):
  """`cli.early_unknown_field` (the check before the library is imported)
  refuses an override only with the full parse's own error, for config
  files that add or remove fields, take an argument, hold a dict or import
  more of the library, and every committed config; it decides the typos it
  can (every committed config's) without importing JAX or TensorFlow.
  The full parse is ml_collections' with the library loaded, in another
  interpreter."""
  for name, text in CHANGING_CONFIGS.items():
    (tmp_path / name).write_text(textwrap.dedent(text))
  argvs = [["jaxrlhf.main", "--config=" + (
      config if config.startswith("configs/") else f"{tmp_path}/{config}"),
            "--config." + override] for config, override, _, _ in CASES]
  early = run_python(f"""
      import json, sys
      from jaxrlhf import cli
      out = []
      for argv in {argvs!r}:
        sys.argv = argv  # where the config flag reads the overrides
        error = cli.early_unknown_field(argv)
        out.append(error and cli.unknown_field_message(argv, error))
      print(json.dumps({{"messages": out, "loaded": [
          m for m in ("jax", "jaxrlhf.defaults", "jaxrlhf.algorithms")
          + {HEAVY!r} if m in sys.modules]}}))
      """)
  full = run_python(f"""
      import json, sys
      from absl import flags
      from ml_collections import config_flags
      from jaxrlhf import cli, defaults
      out = []
      for argv in {argvs!r}:
        parsed = flags.FlagValues()
        config_flags.DEFINE_config_file("config", flag_values=parsed,
                                        lock_config=True, sys_argv=argv)
        try:
          parsed(argv)
          out.append(None)
        except Exception as e:
          error = cli._unknown_field_error(e)
          out.append(cli.unknown_field_message(argv, error) if error
                     else f"{{type(e).__name__}}: {{e}}")
      print(json.dumps(out))
      """)
  assert early.returncode == 0, early.stderr[-3000:]
  assert full.returncode == 0, full.stderr[-3000:]
  early = json.loads(early.stdout.splitlines()[-1])
  full = json.loads(full.stdout.splitlines()[-1])
  assert early["loaded"] == []
  for (config, override, accepted, decided), ours, reference in zip(
      CASES, early["messages"], full):
    assert (reference is None) == accepted, (config, override, reference)
    assert (ours is not None) == decided, (config, override, reference)
    if decided:
      assert ours == reference, (config, override)
  assert full[0].startswith(
      "unknown config field 'train.num_stepz' (from --config.train."
      "num_stepz=3): 'train' has no field 'num_stepz'. "
      'Did you mean "num_steps"?')

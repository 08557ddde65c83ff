"""config.train.wandb: Weights & Biases gets the rows metrics.jsonl gets.

Truths used: metrics.jsonl (the run's own record, written by the same
logger), read back against the rows of wandb's offline run file, parsed
here from its documented layout (a header, then 32 KiB blocks of
length-prefixed chunks, each record a `wandb_internal_pb2.Record`): wandb
0.31 has no Python reader of its own, and `wandb.Api` reads only uploaded
runs. No network: the run is offline.
"""

import importlib.util
import json
import pathlib

import jax
import pytest

from conftest import tiny_config
from jaxrlhf import defaults
from jaxrlhf.train import loop
from jaxrlhf.train import metrics


def _records(path: pathlib.Path):
  """The Records of a .wandb file, in order: after a 7-byte header
  (":W&B", a 2-byte key, a version byte), 32 KiB blocks of chunks, each a
  7-byte head (CRC-32C, little-endian 2-byte length, type: 1 a whole
  record, 2/3/4 its first/middle/last piece) and its bytes; a block's tail
  shorter than a head is padding."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  data = path.read_bytes()
  assert data[:4] == b":W&B", f"{path} is not a wandb run file"
  block, head = 32768, 7
  position, pieces = head, b""
  while position + head <= len(data):
    left = block - position % block
    if left < head:
      position += left
      continue
    length = int.from_bytes(data[position + 4:position + 6], "little")
    kind = data[position + 6]
    pieces += data[position + head:position + head + length]
    position += head + length
    if kind in (1, 4):
      yield wandb_internal_pb2.Record.FromString(pieces)
      pieces = b""
  assert not pieces, f"{path} ends inside a record"


def _item_name(item):
  return item.key or "/".join(item.nested_key)


def test_wandb_logs_every_row_of_metrics_jsonl_at_its_step(
    tmp_path, monkeypatch, capfd):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")  # (no network, whatever else)
  # The run's files go under its workdir (the writer's default): a
  # WANDB_DIR read once by an earlier wandb start in this process would
  # not be this test's.
  monkeypatch.delenv("WANDB_DIR", raising=False)
  workdir = tmp_path / "run"
  # Evaluations at steps 1 and 2 are written before the train rows of
  # steps 1-3 (buffered to the log at step 3): wandb gets rows whose steps
  # go back, as metrics.jsonl does.
  config = tiny_config(algorithm="sft", train__num_steps=3,
                       train__log_every=3, eval__every_steps=1,
                       train__wandb=True, train__wandb_mode="offline",
                       train__wandb_project="jaxrlhf-test")
  capfd.readouterr()
  loop.train(config, str(workdir), devices=jax.devices()[:1])
  console = capfd.readouterr()
  assert "wandb" not in (console.out + console.err).lower(), (
      "wandb printed to the console:\n" + console.out + console.err)

  rows = metrics.read_rows(workdir / metrics.METRICS)
  steps = [r["step"] for r in rows]
  assert 3 in steps and steps != sorted(steps)  # the case described above
  run_files = list(workdir.glob("wandb/offline-run-*/*.wandb"))
  assert len(run_files) == 1, run_files
  records = list(_records(run_files[0]))
  history = []
  for record in records:
    if record.WhichOneof("record_type") == "history":
      row = {_item_name(i): json.loads(i.value_json)
             for i in record.history.item}
      history.append({k: v for k, v in row.items() if not k.startswith("_")})
  assert history == rows

  run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
  assert run.project == "jaxrlhf-test" and run.display_name == "run"
  # Every scalar is plotted against the training step, not wandb's own.
  defined = {m.glob_name: m.step_metric for r in records
             if r.WhichOneof("record_type") == "metric"
             for m in [r.metric] if m.glob_name}
  assert defined == {"*": "step"}


def test_the_field_on_without_the_package_is_refused_in_one_line(
    monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(
      importlib.util, "find_spec",
      lambda name, *a: None if name == "wandb" else find_spec(name, *a))
  config = defaults.base_config()
  config.train.wandb = True
  with pytest.raises(ValueError) as raised:
    defaults.validate(config)
  message = str(raised.value)
  assert message.startswith("config.train.wandb: ") and "\n" not in message
  assert "pip install -e .[wandb]" in message
  config.train.wandb = False
  defaults.validate(config)

"""The run a notebook steps itself (`jaxrlhf.api.Run`), and what
`data.inputs_length` means: the prompt as the model reads it.

Truths used: a checkpoint the command-line loop wrote (restored, it is the
same parameters); the model's own argmax (a greedy completion's first
token); the token count of a prompt written by hand.
"""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxrlhf import api
from jaxrlhf import checkpoint_files
from jaxrlhf.data import pipeline
from jaxrlhf.train import loop


@pytest.fixture(scope="module")
def run():
  return api.Run(tiny_config(algorithm="sft", optimizer__warmup_steps=0),
                 evaluate=False, devices=jax.devices()[:1])


def test_a_run_steps_on_its_batches_and_lowers_the_loss(run):
  state = run.init()
  batch = next(run.batches())
  losses = []
  for _ in range(5):  # the same batch: its loss must fall
    state, metrics = run.step(state, batch)
    assert isinstance(metrics["loss"], float)
    losses.append(metrics["loss"])
  assert int(state.step) == 5 and losses[-1] < losses[0] - 0.1
  for batch in itertools.islice(run.batches(position=5), 2):
    state, metrics = run.step(state, batch)
  assert run.evaluate(state) == {}  # evaluate=False
  spec = run.batch_spec()
  assert spec["decoder_target_tokens"].shape == (
      run.config.train.batch_size, run.config.data.targets_length)


def test_greedy_samples_follow_the_models_argmax(run):
  state = run.init()
  prompts = ["summarize: fox owl fox", "summarize: red"]
  texts = run.sample(state, prompts, greedy=True)
  assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
  vocabulary = run.trainer.vocabulary
  for prompt, text in zip(prompts, texts):
    tokens = jnp.asarray([list(vocabulary.encode(prompt)) + [1]])
    logits = run.trainer.model.apply({"params": state.params["policy"]},
                                     tokens, jnp.zeros((1, 1), jnp.int32))
    first = int(jnp.argmax(logits[0, 0]))
    if first == vocabulary.eos_id:
      assert text == ""
    else:  # (an untrained model's argmax may be an unused id: " ⁇ ")
      assert text.split()[0] == vocabulary.decode([first]).strip(), (
          prompt, text)
  with pytest.raises(ValueError, match="inputs_length"):
    run.sample(state, ["summarize: " + "red " * 40])


def test_restore_reads_what_the_loop_wrote(tmp_path):
  config = tiny_config(algorithm="sft", train__num_steps=2,
                       checkpoint__every_steps=2, eval__num_examples=16)
  loop.train(config, str(tmp_path), devices=jax.devices()[:1])
  run = api.Run(config, evaluate=False, devices=jax.devices()[:1])
  state, step = run.restore(str(tmp_path))
  assert step == 2 and int(state.step) == 2
  saved = checkpoint_files.restore_state_as_numpy(
      os.path.join(tmp_path, "checkpoints", "2", "state"))
  jax.tree.map(np.testing.assert_array_equal,
               jax.device_get(state.params), saved["params"])
  with pytest.raises(ValueError, match="no checkpoints"):
    run.restore(str(tmp_path / "missing"))


def test_inputs_length_is_the_prompt_a_decoder_only_model_reads(tmp_path):
  """inputs_length 4 with targets_length 3: a 4-token prompt fills the
  prompt's 4 slots (sequences of 4 + 3), a 5-token one is a bad row."""
  rows = [{"prompt": "summarize: red blue fox", "completion": "red blue"},
          {"prompt": "summarize: red blue fox owl", "completion": "red"}]
  path = tmp_path / "demonstrations.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  config = tiny_config(algorithm="sft", model__arch="llama",
                       model__size="tiny", model__num_encoder_layers=None,
                       data__task="api_prompt_lengths",
                       data__inputs_length=4, data__targets_length=3,
                       data__files__on_bad_row="skip_and_report",
                       train__batch_size=2)
  config.data.files.train = str(path)
  run = api.Run(config, evaluate=False, devices=jax.devices()[:1])
  batch = next(run.batches())
  assert batch["prompt_tokens"].shape == (2, 4)
  assert batch["tokens"].shape == (2, 4 + 3)
  # The kept prompt: 4 tokens ("summarize:" and three words), every slot.
  np.testing.assert_array_equal(batch["prompt_attention_mask"], 1)
  assert run.trainer.vocabulary.decode(
      batch["prompt_tokens"][0].tolist()) == "summarize: red blue fox"
  # The file task counted the longer prompt as a bad row.
  counts = pipeline.get_task("api_prompt_lengths").source.bad_row_counts()
  assert counts == {"prompt_too_long": 1}

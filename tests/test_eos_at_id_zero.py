"""Pythia-style tokenizers (EOS = id 0 = seqio's padding): the vocabulary
exchanges ids 0 and the padding id, a Hugging Face checkpoint's token rows
are exchanged with them, and a model trained through the run's pipeline
learns to stop at the EOS ("N+ implementation details", detail 3).

The independent truths: the logits transformers computed for the tiny
GPT-NeoX checkpoint in tests/fixtures/hf/pythia (read with the token ids
exchanged, every logit must reappear under its exchanged id), the
`tokenizers` library's own ids, and the demonstrations the model is trained
to reproduce.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from conftest import FIXTURES, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.data.hf_tokenizer import HFTokenizerVocabulary
from jaxrlhf.models import sampling
from jaxrlhf.models.loading import from_pretrained
from jaxrlhf.models.token_rows import swap_token_rows
from jaxrlhf.rl import rollout
from jaxrlhf.train import loop

NEOX = FIXTURES / "tokenizers" / "neox_style" / "tokenizer.json"
PYTHIA = FIXTURES / "hf" / "pythia"
GPT_NEOX = dict(model__arch="gpt_neox", model__size="tiny",
                model__num_encoder_layers=None)


def exchange(x, a=0, b=1):
  x = np.asarray(x)
  return np.where(x == a, b, np.where(x == b, a, x))


def test_exchanged_rows_give_every_token_its_own_logit():
  module, _, params = from_pretrained(PYTHIA)
  want = np.load(PYTHIA / "expected.npz")
  tokens = np.array(want["tokens"])
  tokens[0, :2] = [0, 1]  # make sure both exchanged ids are read
  logits = lambda p, t: np.asarray(module.apply(
      {"params": p}, jnp.asarray(t), jnp.asarray(want["positions"]),
      jnp.asarray(want["attention_mask"])))
  real = np.asarray(want["attention_mask"]) == 1
  hf = logits(params, tokens)[real]
  # On the fixture's own tokens the model is transformers' model.
  np.testing.assert_allclose(logits(params, want["tokens"])[real],
                             want["logits"][real], atol=1e-5, rtol=1e-5)
  swapped = swap_token_rows(module, params, (0, 1))
  mine = logits(swapped, exchange(tokens))[real]
  np.testing.assert_allclose(mine[..., exchange(np.arange(64))], hf,
                             atol=1e-5, rtol=1e-5)
  # The exchange is its own inverse (an export undoes an import).
  again = swap_token_rows(module, swapped, (0, 1))
  for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ValueError, match="need 65 rows"):
    swap_token_rows(module, params, (0, 64))


def _word_tokenizer(path, size=64):
  """A tokenizer of `size` ids laid out like Pythia's: <|endoftext|> 0,
  <|padding|> 1, then words w2, w3, ..."""
  vocab = {"<|endoftext|>": 0, "<|padding|>": 1}
  vocab.update({f"w{i}": i for i in range(2, size)})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      vocab, unk_token="<|endoftext|>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<|endoftext|>", "<|padding|>"])
  tok.save(str(path))
  return path


def _demonstrations(path, pairs):
  with open(path, "w") as f:
    for prompt, completion in pairs:
      f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
  return str(path)


def test_a_run_starting_from_a_hugging_face_folder_exchanges_its_rows(
    tmp_path):
  """init.policy_checkpoint = a Hugging Face folder, data.files.vocabulary =
  a tokenizer.json whose EOS is 0: the loaded policy gives each token the
  logit transformers gave it under the tokenizer's id."""
  tokenizer = _word_tokenizer(tmp_path / "tokenizer.json")
  config = tiny_config(
      algorithm="sft", **GPT_NEOX, model__num_decoder_layers=2,
      model__vocab_size=64, data__task="eos0_hf_folder",
      init__policy_checkpoint=str(PYTHIA))
  config.data.files.train = _demonstrations(tmp_path / "d.jsonl",
                                            [("w2 w3", "w4")])
  config.data.files.vocabulary = str(tokenizer)
  want = np.load(PYTHIA / "expected.npz")
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(algorithms.get("sft"), config, mesh)
    assert trainer.vocabulary.token_swap == (0, 1)
    assert (trainer.vocabulary.eos_id, trainer.vocabulary.pad_id) == (1, 0)
    params = trainer.init_state().params["policy"]
    logits = np.asarray(trainer.model.apply(
        {"params": params}, jnp.asarray(exchange(want["tokens"])),
        jnp.asarray(want["positions"]), jnp.asarray(want["attention_mask"])))
  real = np.asarray(want["attention_mask"]) == 1
  np.testing.assert_allclose(logits[real][..., exchange(np.arange(64))],
                             want["logits"][real], atol=1e-5, rtol=1e-5)


DEMONSTRATIONS = [("the cat sat", " on the mat"),
                  ("the dog sat", " on the log"),
                  ("a cat and a dog", " met on the mat"),
                  ("summarize the post", " tokens everywhere")]


def test_an_eos_at_id_zero_model_trains_samples_and_stops(tmp_path):
  config = tiny_config(
      algorithm="sft", **GPT_NEOX, data__task="eos0_demonstrations",
      data__inputs_length=16, data__targets_length=12, train__num_steps=150,
      train__batch_size=4, optimizer__name="adamw",
      optimizer__learning_rate=3e-3, eval__num_examples=4,
      eval__batch_size=4, checkpoint__every_steps=0, train__log_every=150)
  config.data.files.train = _demonstrations(tmp_path / "d.jsonl",
                                            DEMONSTRATIONS)
  config.data.files.vocabulary = str(NEOX)
  vocab = HFTokenizerVocabulary(NEOX)
  library = tokenizers.Tokenizer.from_file(str(NEOX))
  assert library.token_to_id("<|endoftext|>") == 0
  assert vocab.to_model_id(vocab.eos_id) == 0 and vocab.eos_id == 1

  # The batches: the completion's EOS is weighted, padding (0) is not.
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(algorithms.get("sft"), config, mesh)
    batch = next(trainer.train_batches(0))
  tokens, weights = batch["tokens"], batch["loss_weights"]
  assert np.all(weights[tokens == vocab.eos_id] == 1)
  assert np.all(weights[tokens == 0] == 0)
  assert np.sum(tokens == vocab.eos_id) == len(tokens)  # one per row

  loop.train(config, str(tmp_path / "run"))
  module, _, params = from_pretrained(tmp_path / "run")
  prompts = np.zeros((4, 16), np.int32)
  for i, (prompt, _) in enumerate(DEMONSTRATIONS):
    ids = vocab.encode(prompt) + [vocab.eos_id]
    prompts[i, :len(ids)] = ids
  left, mask = rollout.left_pad_prompts(prompts, vocab.eos_id)
  out = sampling.sample_decoder_only(
      module, params, left, mask, jax.random.PRNGKey(0), 12, greedy=True,
      eos_id=vocab.eos_id)
  for row, has_eos, (_, completion) in zip(np.asarray(out.tokens),
                                           np.asarray(out.has_eos),
                                           DEMONSTRATIONS):
    want = library.encode(completion).ids
    # Stops: the completion, then the EOS (tokenizer id 0), then padding.
    assert has_eos
    assert row[:len(want) + 1].tolist() == want + [vocab.eos_id]
    assert np.all(row[len(want) + 1:] == 0)
    assert vocab.to_model_id(int(row[len(want)])) == 0
    assert vocab.decode(row) == completion

"""HFTokenizerVocabulary against the `tokenizers` library and by hand.

Fixtures: tests/fixtures/tokenizers/*/tokenizer.json, made by
experiments/make_tokenizer_fixtures.py with the `tokenizers` library.
"""

import json
import pathlib
import pickle

import numpy as np
import pytest
import seqio
import tensorflow as tf
import tokenizers

from jaxrlhf.data.hf_tokenizer import HFTokenizerVocabulary

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "tokenizers"
WORDLEVEL = FIXTURES / "wordlevel" / "tokenizer.json"
LLAMA = FIXTURES / "llama_style" / "tokenizer.json"
NEOX = FIXTURES / "neox_style" / "tokenizer.json"

TEXTS = [
    "the cat sat on the mat",
    "a reward model scores the completion",
    "héllo wörld! 🙂 ünïcode",
    "numbers 12345 and  double  spaces",
    "",
]


def _vocab(path, **kwargs):
  return HFTokenizerVocabulary(path, **kwargs)


def _library_ids(vocab, ids):
  """The tokenizer's ids as the vocabulary's model ids (NEOX's EOS 0 and
  padding 1 trade places; the other fixtures pad with 0 already)."""
  return [vocab.to_model_id(i) for i in ids]


def _library(path):
  return tokenizers.Tokenizer.from_file(str(path))


# --- encode / decode ---------------------------------------------------------


@pytest.mark.parametrize("path", [WORDLEVEL, LLAMA, NEOX],
                         ids=lambda p: p.parent.name)
def test_encode_equals_tokenizers_library(path):
  vocab, library = _vocab(path), _library(path)
  for text in TEXTS:
    assert list(vocab.encode(text)) == _library_ids(vocab, library.encode(
        text, add_special_tokens=False).ids), text


def test_wordlevel_ids_by_hand():
  # The WordLevel vocabulary is a plain word -> id table: look words up in it.
  table = json.loads(WORDLEVEL.read_text())["model"]["vocab"]
  vocab = _vocab(WORDLEVEL)
  text = "the dog sat on a mat"
  assert vocab.encode(text) == [table[w] for w in text.split()]
  assert vocab.encode("the zebra") == [table["the"], table["<unk>"]]
  assert vocab.decode([table["cat"], table["sat"]]) == "cat sat"


@pytest.mark.parametrize("path,texts", [
    (LLAMA, TEXTS[:4]),   # byte fallback reproduces any character
    (NEOX, TEXTS),        # byte-level BPE reproduces any string
    (WORDLEVEL, ["the cat sat on the mat"]),  # in-vocabulary words only
], ids=["llama_style", "neox_style", "wordlevel"])
def test_round_trip(path, texts):
  vocab = _vocab(path)
  for text in texts:
    assert vocab.decode(vocab.encode(text)) == text


def test_decode_stops_at_eos_and_drops_padding_and_specials():
  vocab, library = _vocab(LLAMA), _library(LLAMA)
  ids = list(vocab.encode("the cat sat"))
  text = library.decode(ids)
  assert text == "the cat sat"
  assert vocab.decode(ids + [vocab.eos_id] + ids) == text
  assert vocab.decode([vocab.bos_id] + ids + [vocab.pad_id] * 3) == text
  # Out-of-range ids are dropped rather than crashing the decoder.
  assert vocab.decode(ids + [vocab.vocab_size + 5]) == text
  # Keeping special tokens still drops padding (here the special <unk> 0).
  keep = _vocab(LLAMA, skip_special_tokens=False)
  assert keep.decode([keep.bos_id] + ids + [keep.pad_id] * 2) == library.decode(
      [keep.bos_id] + ids, skip_special_tokens=False)
  assert keep.decode([keep.bos_id] + ids).startswith("<s>")


def test_add_special_tokens_uses_the_post_processor():
  vocab = _vocab(LLAMA, add_special_tokens=True)
  ids = vocab.encode("the cat")
  assert ids == _library(LLAMA).encode("the cat").ids  # library default
  assert ids[0] == vocab.bos_id == 1
  assert vocab.decode(ids) == "the cat"


# --- special ids -------------------------------------------------------------


def test_special_ids_resolved_from_each_layout():
  # Expected ids as laid out by experiments/make_tokenizer_fixtures.py.
  w = _vocab(WORDLEVEL)
  assert (w.pad_id, w.eos_id, w.unk_id, w.bos_id) == (0, 1, 2, None)
  table = json.loads(WORDLEVEL.read_text())["model"]["vocab"]
  assert w.vocab_size == len(table)
  # llama_style: eos/bos from tokenizer_config.json, no pad token declared,
  # so padding falls back to the special id 0 (<unk>), as Llama 2 does.
  l = _vocab(LLAMA)
  assert (l.pad_id, l.eos_id, l.unk_id, l.bos_id) == (0, 2, 0, 1)
  # neox_style (GPT-NeoX / Pythia): <|endoftext|> is id 0, <|padding|> id 1;
  # the model's ids exchange them, so padding is seqio's 0 and EOS is not.
  n = _vocab(NEOX)
  assert (n.pad_id, n.eos_id, n.unk_id, n.bos_id) == (0, 1, None, None)
  assert n.token_swap == (0, 1) and n.vocab_size == 340
  assert _library(NEOX).id_to_token(0) == "<|endoftext|>"
  assert _library(NEOX).id_to_token(1) == "<|padding|>"
  # Its own ids, when asked (and the collision allowed).
  own = _vocab(NEOX, pad_to_id_zero=False, allow_pad_eos_collision=True)
  assert (own.pad_id, own.eos_id, own.token_swap) == (1, 0, None)
  assert l.token_swap is None and w.token_swap is None


def test_explicit_ids_override_and_config_file_is_read(tmp_path):
  v = _vocab(LLAMA, eos_id=1, bos_id=None)
  assert (v.eos_id, v.bos_id) == (1, None)
  config = tmp_path / "tokenizer_config.json"
  config.write_text(json.dumps({"eos_token": "<s>", "pad_token": "</s>"}))
  v = _vocab(LLAMA, tokenizer_config_file=config)
  # </s> (2) pads: it trades ids with 0 (<unk>), so padding is model id 0.
  assert (v.eos_id, v.pad_id, v.token_swap) == (1, 0, (0, 2))
  assert v.to_model_id(v.pad_id) == 2


def test_neox_eos_at_zero_is_refused_without_the_exchange():
  with pytest.raises(ValueError, match=r"eos_id is 0 .*detail 3"):
    HFTokenizerVocabulary(NEOX, pad_to_id_zero=False)


def test_neox_ids_round_trip_through_the_exchange():
  """Model ids <-> the tokenizer's: EOS 0 <-> 1, padding 1 <-> 0, every
  other id unchanged; decoding drops the padding and stops at the EOS."""
  v, library = _vocab(NEOX), _library(NEOX)
  text = "the cat sat on the mat"
  ids = library.encode(text).ids
  assert 0 not in ids and 1 not in ids
  assert v.encode(text) == ids
  assert [v.to_model_id(i) for i in (0, 1, 2, 339)] == [1, 0, 2, 339]
  assert v.decode([0, 0] + ids + [v.eos_id] + ids + [0]) == text
  assert library.decode([library.token_to_id("<|endoftext|>")],
                        skip_special_tokens=False) == (
      v.tokenizer.decode([v.to_model_id(v.eos_id)],
                         skip_special_tokens=False))


def test_padding_declared_as_the_eos_gets_an_id_of_its_own(tmp_path):
  """A tokenizer_config.json that pads with the EOS (a common default, which
  detail 3 warns against): padding becomes a new id past the tokenizer's
  last, exchanged with 0; the EOS keeps its id."""
  config = tmp_path / "tokenizer_config.json"
  config.write_text(json.dumps({"eos_token": "<|endoftext|>",
                                "pad_token": "<|endoftext|>"}))
  v = _vocab(NEOX, tokenizer_config_file=config)
  size = _library(NEOX).get_vocab_size()
  assert v.token_swap == (0, size) and v.vocab_size == size + 1
  # <|endoftext|> was id 0: it is now the new id; 0 is padding.
  assert (v.pad_id, v.eos_id) == (0, size)
  assert v.decode(v.encode("a cat") + [v.eos_id, 0]) == "a cat"


def test_pad_equal_to_eos_is_refused_unless_allowed():
  with pytest.raises(ValueError, match="eos_id and pad_id are both 1"):
    HFTokenizerVocabulary(WORDLEVEL, pad_id=1)
  v = HFTokenizerVocabulary(WORDLEVEL, pad_id=1, allow_pad_eos_collision=True)
  assert v.pad_id == v.eos_id == 1


def _save(tmp_path, tok, name="tokenizer.json"):
  path = tmp_path / name
  tok.save(str(path))
  return path


def test_ordinary_token_at_id_zero_is_refused(tmp_path):
  # GPT-2 / Llama 3 layout: id 0 is the text token "!".
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {"!": 0, "hi": 1, "</s>": 2, "<pad>": 3}, unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["</s>", "<pad>"])
  path = _save(tmp_path, tok)
  with pytest.raises(ValueError, match=r"ordinary token '!'"):
    HFTokenizerVocabulary(path, pad_to_id_zero=False)
  v = HFTokenizerVocabulary(path, pad_to_id_zero=False,
                            allow_text_token_at_id_zero=True)
  assert (v.eos_id, v.pad_id) == (2, 3)
  assert v.encode("hi !") == [1, 0]
  # By default "!" and the padding <pad> (3) trade ids: "!" is 3, padding 0.
  v = HFTokenizerVocabulary(path)
  assert (v.eos_id, v.pad_id, v.token_swap) == (2, 0, (0, 3))
  assert v.encode("hi !") == [1, 3]
  assert v.decode([1, 3, 2, 3]) == "hi !"


def test_saved_padding_and_truncation_are_ignored(tmp_path):
  tok = _library(WORDLEVEL)
  tok.enable_truncation(max_length=2)
  tok.enable_padding(pad_id=0, length=8)
  text = "the cat sat on the mat"
  assert len(tok.encode(text).ids) == 8  # what the file alone would give
  vocab = HFTokenizerVocabulary(_save(tmp_path, tok))
  assert vocab.encode(text) == _library(WORDLEVEL).encode(text).ids
  assert len(vocab.encode(text)) == 6


def test_unresolvable_or_bad_inputs_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer file"):
    HFTokenizerVocabulary(tmp_path / "missing.json")
  with pytest.raises(ValueError, match=r"pad_id=9999 is not an id"):
    HFTokenizerVocabulary(WORDLEVEL, pad_id=9999)
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="not a readable tokenizer.json"):
    HFTokenizerVocabulary(bad)
  config = tmp_path / "tokenizer_config.json"
  config.write_text(json.dumps({"eos_token": "<|nope|>"}))
  with pytest.raises(ValueError, match=r"eos_token='<\|nope\|>'.*not in"):
    HFTokenizerVocabulary(LLAMA, tokenizer_config_file=config)
  # No EOS-like token at all (own directory: no tokenizer_config.json).
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {"<pad>": 0, "a": 1}, unk_token="<pad>"))
  tok.add_special_tokens(["<pad>"])
  (tmp_path / "no_eos").mkdir()
  with pytest.raises(ValueError, match="declares no EOS"):
    HFTokenizerVocabulary(_save(tmp_path / "no_eos", tok))


def test_equality_hash_and_pickle():
  a, b = _vocab(LLAMA), _vocab(LLAMA)
  assert a == b and hash(a) == hash(b)
  assert a != _vocab(LLAMA, eos_id=1)
  assert a != _vocab(WORDLEVEL)
  assert a != seqio.PassThroughVocabulary(size=a.vocab_size)
  c = pickle.loads(pickle.dumps(a))
  assert c == a and c.encode("the cat") == a.encode("the cat")


# --- TensorFlow and seqio ----------------------------------------------------


def test_encode_tf_and_decode_tf_match_python():
  vocab = _vocab(NEOX)
  for text in TEXTS:
    ids = vocab.encode_tf(tf.constant(text))
    assert ids.dtype == tf.int32 and ids.shape.rank == 1
    assert ids.numpy().tolist() == vocab.encode(text)
  ragged = vocab.encode_tf(tf.constant(TEXTS))
  assert isinstance(ragged, tf.RaggedTensor)
  assert ragged.to_list() == [vocab.encode(t) for t in TEXTS]
  # Batched decode of [batch, length] rows padded with pad_id, EOS inside.
  rows = [vocab.encode(t) + [vocab.eos_id] for t in TEXTS[:3]]
  width = max(map(len, rows)) + 2
  dense = np.full((3, width), vocab.pad_id, np.int32)
  for i, r in enumerate(rows):
    dense[i, :len(r)] = r
  dense[0, -1] = vocab.encode("mat")[0]  # after EOS: must not be decoded
  texts = vocab.decode_tf(tf.constant(dense))
  assert texts.shape == (3,)
  assert [t.decode() for t in texts.numpy()] == TEXTS[:3]
  scalar = vocab.decode_tf(tf.constant(dense[1]))
  assert scalar.shape == () and scalar.numpy().decode() == TEXTS[1]


def test_encode_tf_inside_tf_data_graph():
  vocab = _vocab(LLAMA)
  ds = tf.data.Dataset.from_tensor_slices(TEXTS).map(
      vocab.encode_tf, num_parallel_calls=4, deterministic=True)
  got = [x.numpy().tolist() for x in ds]
  assert got == [_library(LLAMA).encode(t, add_special_tokens=False).ids
                 for t in TEXTS]


@pytest.fixture
def seqio_task():
  name = "test_hf_tokenizer_llama_style_task"
  vocab = _vocab(LLAMA)
  prompts = ["summarize the following post", "héllo wörld 🙂"]
  answers = ["the cat sat on the mat", "a dog met a cat"]

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices(
        {"inputs": prompts, "targets": answers})

  seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      preprocessors=[seqio.preprocessors.tokenize,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={
          "inputs": seqio.Feature(vocabulary=vocab, add_eos=True),
          "targets": seqio.Feature(vocabulary=vocab, add_eos=True)})
  yield name, vocab, prompts, answers
  seqio.TaskRegistry.remove(name)


def test_seqio_task_produces_library_ids(seqio_task):
  name, vocab, prompts, answers = seqio_task
  library = _library(LLAMA)
  lengths = {"inputs": 32, "targets": 32}
  ds = seqio.get_mixture_or_task(name).get_dataset(
      lengths, split="train", shuffle=False, use_cached=False)
  examples = list(ds.as_numpy_iterator())
  assert len(examples) == 2
  for ex, prompt, answer in zip(examples, prompts, answers):
    eos = [vocab.eos_id]
    assert ex["inputs"].tolist() == library.encode(
        prompt, add_special_tokens=False).ids + eos
    assert ex["targets"].tolist() == library.encode(
        answer, add_special_tokens=False).ids + eos
    assert ex["targets_pretokenized"].decode() == answer
    assert vocab.decode(ex["targets"].tolist()) == answer

  # Through seqio's decoder-only feature converter: the target EOS (id 2, not
  # seqio's padding 0) keeps its loss weight, as PPO paper detail 3 requires.
  converter = seqio.PrefixLMFeatureConverter(pack=False)
  feats = next(converter(ds, lengths).as_numpy_iterator())
  targets = feats["decoder_target_tokens"]
  weights = feats["decoder_loss_weights"]
  last = int(np.nonzero(targets)[0][-1])
  assert targets[last] == vocab.eos_id and weights[last] == 1
  assert np.all(weights[last + 1:] == 0)

"""A seqio Vocabulary over a Hugging Face `tokenizer.json`.

`HFTokenizerVocabulary` wraps the `tokenizers` library (Rust, no torch) so
that a Llama, GPT-NeoX, Pythia, ... tokenizer can be the vocabulary of a seqio
Feature:

  vocab = HFTokenizerVocabulary('/ckpt/llama/tokenizer.json')
  seqio.Feature(vocabulary=vocab, add_eos=True)

Special ids. `eos_id`, `pad_id`, `bos_id` and `unk_id` can be given; by
default they are read from a `tokenizer_config.json` beside the tokenizer
file (its `eos_token`, `pad_token`, ... entries), else from well-known token
names present in the vocabulary (`</s>`, `<|end_of_text|>`, `<|endoftext|>`;
`<pad>`, `<|padding|>`, `[PAD]`, ...), and the unknown token from the
tokenizer model itself.

Padding must differ from EOS (PPO implementation-details paper, detail 3):
if the two share an id, masking padding also masks the EOS, and the model
never learns to stop. Two places pad here: code that honours
`vocabulary.pad_id`, and seqio itself, whose feature converters always pad
with 0 and take loss weights and attention masks from `token != 0`, whatever
the vocabulary says. So by default (`pad_to_id_zero=True`) the vocabulary
makes id 0 the padding without changing what any id means: when the
tokenizer's padding token is not at id 0 (GPT-NeoX/Pythia: id 0 is the EOS
`<|endoftext|>`, the padding `<|padding|>` is id 1; GPT-2 and Llama 3: id 0
is the text token "!"), the ids 0 and P trade places in everything the
vocabulary encodes and decodes, P being the tokenizer's padding token or,
when it has none (or declares the EOS as its padding, as many
`tokenizer_config.json` files do), a new padding id one past its last id
(the paper's added "[PAD]"). The model's token ids are then the tokenizer's
with 0 and P exchanged (`token_swap`); a Hugging Face checkpoint's embedding
and output rows are exchanged the same way when a run loads it
(`jaxrlhf.models.token_rows.swap_token_rows`), so every token keeps its
embedding and its logit. Pythia's EOS is then model id 1 and its padding 0.

With `pad_to_id_zero=False` the ids are the tokenizer's, and the constructor
refuses
  - eos_id == pad_id, and
  - eos_id == 0 (GPT-NeoX/Pythia's `<|endoftext|>`),
unless `allow_pad_eos_collision=True`; and, because of the same seqio
convention, it refuses a tokenizer whose id 0 is an ordinary text token
unless `allow_text_token_at_id_zero=True`. Both escapes are for pipelines
that pad with `pad_id` themselves.

TensorFlow ops. `encode_tf` / `decode_tf` call the Rust tokenizer through
`tf.numpy_function`; `tensorflow_text` has no op that runs a generic
`tokenizer.json` (BPE with byte-level or byte-fallback pre/post-processing).
The costs: each call crosses into Python and holds the GIL, so the 256
parallel calls of seqio's `tokenize` preprocessor run one at a time in the
Python part; and a graph that contains the op cannot be serialised
(SavedModel, tf.data service) or run without this Python process. For scale,
on a busy 2-core machine a 50-word string took about 80 us to encode in
Python and about 320 us per example through `tf.data` (iteration included).
Pre-tokenise with seqio's offline caching when tokenisation is the
bottleneck.
"""

import hashlib
import json
import os
from typing import Any, Iterable, Optional, Sequence, Tuple, Union

import numpy as np
import seqio
import tensorflow as tf
import tokenizers

# Searched in this order when neither the argument nor tokenizer_config.json
# names the token.
EOS_TOKEN_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>",
                   "<|im_end|>")
PAD_TOKEN_NAMES = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>",
                   "<|finetune_right_pad_id|>")
BOS_TOKEN_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")

# seqio's feature converters pad with this id and treat it as padding.
SEQIO_PAD_ID = seqio.vocabularies.PAD_ID

_UNSET = object()


def token_content(entry: Any) -> Optional[str]:
  """tokenizer_config.json stores a token as a string or an AddedToken dict."""
  if entry is None or isinstance(entry, str):
    return entry
  if isinstance(entry, dict) and isinstance(entry.get("content"), str):
    return entry["content"]
  raise ValueError(f"tokenizer_config.json: cannot read a token from {entry!r}"
                   "; expected a string or {'content': ...}.")


class HFTokenizerVocabulary(seqio.Vocabulary):
  """seqio Vocabulary backed by a `tokenizers.Tokenizer` (`tokenizer.json`).

  `encode` returns the tokenizer's ids without EOS (seqio's contract; the
  Feature's `add_eos` appends `eos_id`), with ids 0 and P exchanged when
  `token_swap` is (0, P) (see the module docstring). `decode` stops after the
  first EOS (seqio), then drops padding, ids outside the vocabulary and, by
  default, special tokens. Every id the vocabulary takes or gives (`eos_id`,
  `pad_id`, ...) is a model id.
  """

  def __init__(self,
               tokenizer_file: Union[str, os.PathLike],
               *,
               eos_id: Optional[int] = None,
               pad_id: Optional[int] = None,
               bos_id: Any = _UNSET,
               unk_id: Any = _UNSET,
               tokenizer_config_file: Union[str, os.PathLike, None] = None,
               add_special_tokens: bool = False,
               skip_special_tokens: bool = True,
               allow_pad_eos_collision: bool = False,
               allow_text_token_at_id_zero: bool = False,
               pad_to_id_zero: bool = True):
    """Loads the tokenizer and resolves its special ids.

    The special ids given as arguments are the tokenizer's own ids (as in
    its tokenizer.json); the properties report model ids.

    Args:
      tokenizer_file: path of a Hugging Face `tokenizer.json`.
      eos_id: end-of-sequence id; default from tokenizer_config.json's
        `eos_token`, else the first of EOS_TOKEN_NAMES in the vocabulary.
      pad_id: padding id; default from tokenizer_config.json's `pad_token`
        (unless it is the EOS), else the first of PAD_TOKEN_NAMES in the
        vocabulary, else 0 when id 0 is a special token that is not the EOS
        (Llama 2's `<unk>`), else (with `pad_to_id_zero`) a new id one past
        the tokenizer's last.
      bos_id: beginning-of-sequence id or None; default from the config's
        `bos_token`, else BOS_TOKEN_NAMES, else None.
      unk_id: unknown-token id or None; default the tokenizer model's unknown
        token (None for byte-level BPE, which has none).
      tokenizer_config_file: a `tokenizer_config.json`; default the one next
        to `tokenizer_file` if it exists.
      add_special_tokens: let the tokenizer's post-processor add its special
        tokens when encoding (e.g. Llama's leading `<s>`). Off by default:
        seqio features carry bare text ids.
      skip_special_tokens: drop special tokens when decoding.
      allow_pad_eos_collision: accept eos_id == pad_id or eos_id == 0 (see
        the module docstring); only for pipelines that mask padding by
        position rather than by id.
      allow_text_token_at_id_zero: accept a tokenizer whose id 0 is an
        ordinary token, although seqio pads with 0.
      pad_to_id_zero: exchange ids 0 and the padding id when they differ,
        so that id 0 is the padding seqio assumes (module docstring); the
        two escapes above then do not apply.

    Raises:
      FileNotFoundError: a file does not exist.
      ValueError: a special token cannot be resolved, an id is out of range,
        or the ids collide as described above.
    """
    super().__init__(extra_ids=0)
    self._tokenizer_file = os.fspath(tokenizer_file)
    if not os.path.isfile(self._tokenizer_file):
      raise FileNotFoundError(
          f"HFTokenizerVocabulary: no tokenizer file at {self._tokenizer_file}"
          " (expected a Hugging Face tokenizer.json).")
    try:
      self._tokenizer = tokenizers.Tokenizer.from_file(self._tokenizer_file)
    except Exception as e:  # the Rust side raises a bare Exception
      raise ValueError(f"HFTokenizerVocabulary: {self._tokenizer_file} is not "
                       f"a readable tokenizer.json: {e}") from e
    # A saved tokenizer.json may carry padding/truncation settings; seqio
    # trims and pads itself, and encode must return every id.
    self._tokenizer.no_padding()
    self._tokenizer.no_truncation()
    self._config_file = None
    self._add_special_tokens = bool(add_special_tokens)
    self._skip_special_tokens = bool(skip_special_tokens)
    vocab = self._tokenizer.get_vocab(with_added_tokens=True)
    # Ids may have holes; the size is what an embedding table must cover.
    self._size = max(vocab.values()) + 1 if vocab else 0
    self._special_ids = frozenset(
        i for i, t in self._tokenizer.get_added_tokens_decoder().items()
        if t.special)

    config = self._read_config(tokenizer_config_file)
    self._config = config
    eos = self._resolve("eos", eos_id, config, EOS_TOKEN_NAMES)
    if eos is None:
      raise ValueError(
          f"HFTokenizerVocabulary: {self._tokenizer_file} declares no EOS "
          f"token (no tokenizer_config.json eos_token and none of "
          f"{list(EOS_TOKEN_NAMES)} in the vocabulary); pass eos_id=...")
    pad = self._resolve("pad", pad_id, config, PAD_TOKEN_NAMES)
    if pad == eos and pad_id is None and pad_to_id_zero:
      # A tokenizer_config.json that pads with its EOS (a common default):
      # padding gets an id of its own instead (detail 3).
      pad = None
    if pad is None:
      if SEQIO_PAD_ID in self._special_ids and eos != SEQIO_PAD_ID:
        pad = SEQIO_PAD_ID
      elif pad_to_id_zero:
        pad = self._size  # a new padding id: the paper's added [PAD]
      else:
        raise ValueError(
            f"HFTokenizerVocabulary: {self._tokenizer_file} declares no "
            f"padding token (no tokenizer_config.json pad_token and none of "
            f"{list(PAD_TOKEN_NAMES)} in the vocabulary); pass pad_id=... "
            "with the id of a special token that is not the EOS.")
    bos = self._resolve(
        "bos", None if bos_id is _UNSET else bos_id, config, BOS_TOKEN_NAMES,
        explicit_none=bos_id is None)
    if unk_id is _UNSET:
      unk_id = self._model_unk_id()
    unk = self._check_id("unk_id", unk_id)
    # Tokenizer ids 0 and `pad` trade places in the model's ids (a pad
    # equal to the EOS, given explicitly, is refused or allowed below).
    self._swap = ((SEQIO_PAD_ID, pad) if pad_to_id_zero and pad not in (
        SEQIO_PAD_ID, eos) else None)
    self._base_size = max(self._size, pad + 1)
    if self._swap is None:
      self._check_padding(eos, pad, allow_pad_eos_collision,
                          allow_text_token_at_id_zero or pad_to_id_zero)
    self._eos_id, self._pad_id, self._bos_id, self._unk_id = (
        self.to_model_id(i) for i in (eos, pad, bos, unk))
    self._key = (
        hashlib.sha256(self._tokenizer.to_str().encode("utf-8")).hexdigest(),
        self._eos_id, self._pad_id, self._bos_id, self._unk_id,
        self._add_special_tokens, self._skip_special_tokens, self._swap)

  # --- model ids ------------------------------------------------------------

  @property
  def token_swap(self) -> Optional[Tuple[int, int]]:
    """(0, P) when the model's ids are the tokenizer's with 0 and P
    exchanged (P: the padding id), else None. A Hugging Face checkpoint
    trained with this tokenizer has its token rows exchanged the same way
    when loaded (`jaxrlhf.models.token_rows.swap_token_rows`)."""
    return self._swap

  def to_model_id(self, token_id: Optional[int]) -> Optional[int]:
    """The model id of a tokenizer id (the swap is its own inverse, so this
    also maps model ids back to the tokenizer's)."""
    if token_id is None or self._swap is None:
      return token_id
    a, b = self._swap
    return b if token_id == a else a if token_id == b else token_id

  def _swap_array(self, ids: np.ndarray) -> np.ndarray:
    if self._swap is None:
      return ids
    a, b = self._swap
    return np.where(ids == a, b, np.where(ids == b, a, ids)).astype(ids.dtype)

  # --- resolving special ids ------------------------------------------------

  def _read_config(self, path) -> dict:
    if path is None:
      path = os.path.join(os.path.dirname(self._tokenizer_file),
                          "tokenizer_config.json")
      if not os.path.isfile(path):
        return {}
    path = os.fspath(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f"HFTokenizerVocabulary: no tokenizer_config.json at {path}.")
    with open(path, encoding="utf-8") as f:
      try:
        config = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"HFTokenizerVocabulary: {path} is not JSON: {e}"
                         ) from e
    self._config_file = path
    return config

  def _check_id(self, field: str, value: Optional[int]) -> Optional[int]:
    if value is None:
      return None
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
        or not 0 <= value < self._size):
      raise ValueError(f"HFTokenizerVocabulary: {field}={value!r} is not an id "
                       f"of {self._tokenizer_file} (ids 0..{self._size - 1}).")
    return int(value)

  def _resolve(self, kind: str, given: Optional[int], config: dict,
               names: Sequence[str], explicit_none: bool = False
               ) -> Optional[int]:
    """The id of a special token: argument > tokenizer_config > known names."""
    if given is not None:
      return self._check_id(f"{kind}_id", given)
    if explicit_none:
      return None
    key = f"{kind}_token"
    content = token_content(config.get(key)) if key in config else None
    if content is not None:
      token_id = self._tokenizer.token_to_id(content)
      if token_id is None:
        raise ValueError(
            f"HFTokenizerVocabulary: {self._config_file} sets {key}="
            f"{content!r}, which is not in {self._tokenizer_file}; pass "
            f"{kind}_id=... instead.")
      return token_id
    for name in names:
      token_id = self._tokenizer.token_to_id(name)
      if token_id is not None:
        return token_id
    return None

  def _model_unk_id(self) -> Optional[int]:
    model = json.loads(self._tokenizer.to_str()).get("model", {})
    if model.get("type") == "Unigram":
      return model.get("unk_id")
    unk = model.get("unk_token")
    return None if unk is None else self._tokenizer.token_to_id(unk)

  def _check_padding(self, eos: int, pad: int, allow_collision: bool,
                     allow_text_zero: bool):
    """The tokenizer's own ids, used as they are: refuse what seqio's
    padding with 0 would break (unless allowed)."""
    why = ("EOS would be masked as padding and the model would not learn to "
           "stop (PPO implementation-details paper, detail 3)")
    if not allow_collision:
      if eos == pad:
        raise ValueError(
            f"HFTokenizerVocabulary: eos_id and pad_id are both "
            f"{eos} ({self._token(eos)!r}); {why}. Pass a "
            "pad_id of another special token, or allow_pad_eos_collision="
            "True if your pipeline masks padding by position.")
      if eos == SEQIO_PAD_ID:
        raise ValueError(
            f"HFTokenizerVocabulary: eos_id is 0 ({self._token(0)!r}), the id "
            f"seqio's feature converters pad with and mask as padding, "
            f"whatever pad_id ({pad}) says; {why}. Leave pad_to_id_zero on "
            "(it gives the EOS another id), or use a pipeline that pads with "
            "pad_id and pass allow_pad_eos_collision=True.")
    if not allow_text_zero and SEQIO_PAD_ID not in self._special_ids:
      raise ValueError(
          f"HFTokenizerVocabulary: id 0 of {self._tokenizer_file} is the "
          f"ordinary token {self._token(0)!r}, but seqio pads with 0 and "
          "masks every 0 as padding, so real text would be masked. Leave "
          "pad_to_id_zero on (it gives that token another id), or use a "
          "pipeline that pads with pad_id and pass "
          "allow_text_token_at_id_zero=True.")

  def _token(self, token_id: int) -> Optional[str]:
    return self._tokenizer.id_to_token(token_id)

  # --- seqio.Vocabulary -----------------------------------------------------

  @property
  def tokenizer(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._tokenizer

  @property
  def tokenizer_config(self) -> dict:
    """The tokenizer_config.json read ({} when there is none): its special
    tokens and chat template (`jaxrlhf.data.chat_templates`)."""
    return json.loads(json.dumps(self._config))

  @property
  def add_special_tokens(self) -> bool:
    """Whether `encode` lets the tokenizer's post-processor add its special
    tokens (off by default; a chat template writes them itself)."""
    return self._add_special_tokens

  def token_text(self, model_id: int) -> Optional[str]:
    """The token a model id stands for ("<|im_end|>"), or None for an id
    the tokenizer does not have (a new padding id)."""
    return self._token(self.to_model_id(int(model_id)))

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def bos_id(self) -> Optional[int]:
    return self._bos_id

  @property
  def unk_id(self) -> Optional[int]:
    return self._unk_id

  @property
  def _base_vocab_size(self) -> int:
    return self._base_size

  def _encode(self, s: str) -> Sequence[int]:
    if isinstance(s, bytes):
      s = s.decode("utf-8")
    if not isinstance(s, str):
      raise TypeError(f"HFTokenizerVocabulary.encode takes a str, got "
                      f"{type(s).__name__}.")
    ids = self._tokenizer.encode(
        s, add_special_tokens=self._add_special_tokens).ids
    return [self.to_model_id(i) for i in ids] if self._swap else ids

  def _decode(self, ids: Iterable[int]) -> str:
    kept = [self.to_model_id(int(i)) for i in ids
            if 0 <= int(i) < self._base_size and int(i) != self._pad_id]
    # A new padding id (one past the tokenizer's) is no token of it.
    kept = [i for i in kept if i < self._size]
    return self._tokenizer.decode(
        kept, skip_special_tokens=self._skip_special_tokens)

  # tf.numpy_function bodies: numpy in, numpy out.

  def _encode_strings(self, strings: np.ndarray):
    """[n] bytes -> (concatenated ids int32, [n] lengths int64)."""
    texts = [s.decode("utf-8") for s in strings.reshape(-1).tolist()]
    if len(texts) == 1:  # the per-example case; skips the batch thread pool
      encodings = [self._tokenizer.encode(
          texts[0], add_special_tokens=self._add_special_tokens)]
    else:
      encodings = self._tokenizer.encode_batch(
          texts, add_special_tokens=self._add_special_tokens)
    lengths = np.array([len(e.ids) for e in encodings], np.int64)
    flat = np.fromiter((i for e in encodings for i in e.ids), np.int32,
                       count=int(lengths.sum()))
    return self._swap_array(flat), lengths

  def _decode_rows(self, ids: np.ndarray) -> np.ndarray:
    """[n, length] ids -> [n] UTF-8 bytes."""
    texts = [self._decode(row) for row in ids.tolist()]
    return np.array([t.encode("utf-8") for t in texts], dtype=object)

  def _encode_tf(self, s: tf.Tensor) -> Union[tf.Tensor, tf.RaggedTensor]:
    """Scalar string -> [n] int32; [batch] strings -> ragged [batch, None]."""
    s = tf.convert_to_tensor(s, tf.string)
    rank = s.shape.rank
    if rank not in (0, 1):
      raise ValueError(f"HFTokenizerVocabulary.encode_tf takes a scalar or a "
                       f"vector of strings, got shape {s.shape}.")
    flat, lengths = tf.numpy_function(
        self._encode_strings, [tf.reshape(s, [-1])], [tf.int32, tf.int64],
        stateful=False, name="hf_tokenizer_encode")
    flat.set_shape([None])
    if rank == 0:
      return flat
    lengths.set_shape(s.shape)
    return tf.RaggedTensor.from_row_lengths(flat, lengths, validate=False)

  def _decode_tf(self, ids: Union[tf.Tensor, tf.RaggedTensor]) -> tf.Tensor:
    """[..., length] ids -> [...] strings."""
    if isinstance(ids, tf.RaggedTensor):
      ids = ids.to_tensor(default_value=self._pad_id)
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank is None or ids.shape.rank < 1:
      raise ValueError("HFTokenizerVocabulary.decode_tf takes ids of shape "
                       f"[..., length], got {ids.shape}.")
    outer_shape = tf.shape(ids)[:-1]
    rows = tf.reshape(tf.cast(ids, tf.int64), [-1, tf.shape(ids)[-1]])
    texts = tf.numpy_function(self._decode_rows, [rows], tf.string,
                              stateful=False, name="hf_tokenizer_decode")
    texts = tf.reshape(texts, outer_shape)
    texts.set_shape(ids.shape[:-1])
    return texts

  def __eq__(self, other) -> bool:
    if not isinstance(other, HFTokenizerVocabulary):
      return False
    return self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  def __str__(self) -> str:
    swap = f", token_swap={self._swap}" if self._swap else ""
    return (f"HFTokenizerVocabulary(file={self._tokenizer_file}, "
            f"size={self._base_size}, eos_id={self._eos_id}, "
            f"pad_id={self._pad_id}, bos_id={self._bos_id}, "
            f"unk_id={self._unk_id}{swap}, sha256={self._key[0][:12]})")

  @property
  def tokenizer_file(self) -> str:
    return self._tokenizer_file

  @property
  def fingerprint(self) -> str:
    """Identifies the vocabulary by content: the tokenizer and its ids."""
    return hashlib.sha256(repr(self._key).encode("utf-8")).hexdigest()

  __repr__ = __str__

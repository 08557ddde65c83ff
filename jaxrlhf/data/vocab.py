"""Vocabularies: the built-in tasks' word models, vocabulary files, and how
a vocabulary is identified.

`from_file` reads a SentencePiece model or a Hugging Face tokenizer.json;
`fingerprint` identifies a vocabulary by content (a checkpoint trained on
another vocabulary is refused by it). A built-in task's vocabulary is a
SentencePiece word model made from the task's own word list: no training
run and no download, so the same ids come out on every machine. The model file is cached (content-addressed) under
$JAXRLHF_CACHE_DIR, default ~/.cache/jaxrlhf, and written atomically.

seqio (and TensorFlow with it) loads where a vocabulary is built, not with
this module: a plan (`shapes`) counts a word model's ids without it.
"""

import base64
import hashlib
import os
import pathlib
import tempfile
import zlib
from typing import Sequence, TYPE_CHECKING

from sentencepiece import sentencepiece_model_pb2

if TYPE_CHECKING:
  import seqio  # pylint: disable=g-bad-import-order

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2  # T5's ids

# SentencePiece's compiled character map for one normalisation rule, U+00A0
# (no-break space) -> U+0020 (space), as `SentencePieceTrainer.train(...,
# normalization_rule_tsv=f)` builds it (sentencepiece 0.2) for a rule file f
# holding the line "A0<TAB>20"; stored zlib-compressed. The word models
# carry it so that words separated by a no-break space still split; and
# SentencePiece logs an INFO line every time it loads a model with no
# character map at all, which a run would print dozens of times.
_NBSP_TO_SPACE_CHARSMAP = zlib.decompress(base64.b64decode(
    "eNod03MQFgYYB+DvwuKybdu2bWzLtVq2bdu2ja1WbbmtWlq2bbuer/fuud/de/f+"
    "9bs3ECoQCEQMGdgzOkRgfuhAcPoHI7gOww+EIywRCM+PwRMiE4moRCE60YhJDGIT"
    "i7jEIT7xSEgCEpOIpCQhOclISQpSk4q0pCE96chIBjKTiaxkITvZyEkOcpOLvOQh"
    "P/koSAEKU4iiFKE4xShJCUpTirKUoTzlqEgFKlOJqlShOtWoSQ1qU4u61OFnfqIe"
    "v9CA+jSiIU1oTDOa0pxf+Y0WtKIlbWhNO9rSgfZ0oiNd6Ew3utKD7vSiJ33oTT/6"
    "MiBYOoMYyBAGM4yhjGA4oxjJGEYzjrFMYDyTmMgUJjONqcxgOrOYyRxmM4+5LGA+"
    "i1jIEhazjKWsYDmrWMkaVrOOtWxgPZvYyBY28we/s42tbOdPdrKDv/mL3exiL3vY"
    "zz4OcoB/+YfDHOI/jnCMo5zgOP9zktOc4ixnOM85LnKBy1ziKle4zjVucoPb3OIu"
    "d7jPPR7ygMc84ilPeM4zXvKC17ziLW94zzs+8oHPfOIrX77/3je0koIj"))


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(
      "JAXRLHF_CACHE_DIR", pathlib.Path.home() / ".cache" / "jaxrlhf"))


def word_model_proto(words: Sequence[str]) -> bytes:
  """A serialized SentencePiece WORD model: pad 0, EOS 1, unk 2, then words;
  text is used as it is, but for no-break spaces read as spaces."""
  if len(set(words)) != len(words):
    raise ValueError("word_model_proto: the word list has duplicates.")
  piece_type = sentencepiece_model_pb2.ModelProto.SentencePiece
  model = sentencepiece_model_pb2.ModelProto()
  spec = model.trainer_spec
  spec.model_type = sentencepiece_model_pb2.TrainerSpec.WORD
  spec.vocab_size = len(words) + 3
  spec.pad_id, spec.eos_id, spec.unk_id, spec.bos_id = PAD_ID, EOS_ID, UNK_ID, -1
  model.normalizer_spec.name = "nbsp_to_space"
  model.normalizer_spec.precompiled_charsmap = _NBSP_TO_SPACE_CHARSMAP
  model.normalizer_spec.add_dummy_prefix = True
  model.normalizer_spec.escape_whitespaces = True
  for text, kind in (("<pad>", piece_type.CONTROL), ("</s>", piece_type.CONTROL),
                     ("<unk>", piece_type.UNKNOWN)):
    piece = model.pieces.add()
    piece.piece, piece.score, piece.type = text, 0.0, kind
  for i, word in enumerate(words):
    piece = model.pieces.add()
    # U+2581 marks a word start in SentencePiece.
    piece.piece, piece.score = "\u2581" + word, -1.0 - i
    piece.type = piece_type.NORMAL
  return model.SerializeToString()


def word_vocab_size(words: Sequence[str]) -> int:
  """The ids of `word_model_proto(words)`'s vocabulary: the three special
  ones, then one per word."""
  return len(words) + 3


def word_vocabulary(words: Sequence[str]) -> "seqio.SentencePieceVocabulary":
  """A seqio vocabulary over `words`, cached on disk by content hash."""
  return cached_vocabulary("words", word_model_proto(words))


def cached_vocabulary(name: str, proto: bytes
                      ) -> "seqio.SentencePieceVocabulary":
  """A seqio vocabulary of the serialised SentencePiece model `proto`, from
  a file in `cache_dir()` named by `name` and the model's content hash."""
  import seqio  # pylint: disable=g-import-not-at-top,redefined-outer-name
  path = cache_dir() / f"{name}-{hashlib.sha256(proto).hexdigest()[:16]}.model"
  if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent reader never sees a partial file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(proto)
    os.replace(tmp, path)
  return seqio.SentencePieceVocabulary(str(path))


def from_file(path: str) -> "seqio.Vocabulary":
  """The vocabulary in a file: a Hugging Face `tokenizer.json` (any name
  ending in .json; a `tokenizer_config.json` beside it is read, and id 0 is
  made the padding, see `hf_tokenizer`) or a SentencePiece model."""
  if str(path).endswith(".json"):
    from jaxrlhf.data import hf_tokenizer  # pylint: disable=g-import-not-at-top
    return hf_tokenizer.HFTokenizerVocabulary(path)
  import seqio  # pylint: disable=g-import-not-at-top,redefined-outer-name
  return seqio.SentencePieceVocabulary(str(path))


def fingerprint(vocabulary: "seqio.Vocabulary") -> str:
  """Identifies a vocabulary by content: its SentencePiece model, its
  tokenizer (`HFTokenizerVocabulary.fingerprint`), or else the text of
  every id."""
  sp_model = getattr(vocabulary, "sp_model", None)
  if sp_model:
    return hashlib.sha256(sp_model).hexdigest()
  own = getattr(vocabulary, "fingerprint", None)
  if isinstance(own, str):
    return own
  digest = hashlib.sha256(str(vocabulary.vocab_size).encode())
  for i in range(vocabulary.vocab_size):
    digest.update(vocabulary.decode([i]).encode() + b"\0")
  return digest.hexdigest()


def describe(vocabulary: "seqio.Vocabulary") -> str:
  """"SentencePieceVocabulary ('path', N ids)", for error messages."""
  path = getattr(vocabulary, "sentencepiece_model_file", None)
  tokenizer = getattr(vocabulary, "tokenizer_file", None)
  where = (f"SentencePiece model {path!r}, " if path else
           f"tokenizer {tokenizer!r}, " if tokenizer else "")
  return f"{type(vocabulary).__name__} ({where}{vocabulary.vocab_size} ids)"


class SizeOnlyVocabulary:
  """A vocabulary known by its size and T5's special ids only: what laying
  out a model and its batches needs (`jaxrlhf.plan` reads no vocabulary
  file). It cannot encode or decode."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size
    self.pad_id, self.eos_id, self.unk_id = PAD_ID, EOS_ID, UNK_ID

  def encode(self, text):
    del text
    raise ValueError("SizeOnlyVocabulary: a plan's vocabulary knows its size "
                     "only and cannot encode; build the trainer without "
                     "shapes_only to read text.")

  def decode(self, ids):
    del ids
    raise ValueError("SizeOnlyVocabulary: a plan's vocabulary knows its size "
                     "only and cannot decode; build the trainer without "
                     "shapes_only to read text.")


def require_same(trained, expected, what: str, against: str,
                 fix: str) -> None:
  """The one check that a network reads the vocabulary it was trained with:
  raises "<what> was trained with vocabulary <trained>, but <against> uses
  <expected>, so its token ids would be read as other tokens. <fix>"
  unless the two are the same by content (their shapes may fit either
  way: vocabularies are padded to the same size)."""
  if fingerprint(trained) == fingerprint(expected):
    return
  raise ValueError(
      f"{what} was trained with vocabulary {describe(trained)}, but "
      f"{against} uses {describe(expected)}, so its token ids would be read "
      f"as other tokens. {fix}")

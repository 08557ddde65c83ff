"""Makes the tiny `tokenizer.json` fixtures under tests/fixtures/tokenizers/.

Built with the `tokenizers` library itself, from a corpus written below: no
download. Three layouts, each mimicking a real family's special tokens:

- wordlevel/: T5-like ids (<pad> 0, </s> 1, <unk> 2), a WordLevel model over
  the corpus' words, split on whitespace. Its ids are easy to check by hand.
- llama_style/: Llama 2's pipeline (normaliser prepends and maps spaces to
  U+2581, BPE with byte fallback, ids <unk> 0, <s> 1, </s> 2, then the 256
  <0xNN> byte tokens, then the learnt merges; a post-processor that adds <s>),
  plus a `tokenizer_config.json` naming bos/eos/unk and no pad token.
- neox_style/: GPT-NeoX's byte-level BPE (<|endoftext|> 0, <|padding|> 1,
  then the 256 byte symbols and learnt merges), with no tokenizer_config.json.

  python experiments/make_tokenizer_fixtures.py \
      [--out tests/fixtures/tokenizers]

BPE training is deterministic for a fixed corpus and `tokenizers` version;
the committed files are the reference either way (the tests compare the
adapter with the `tokenizers` library on whatever file is there).
"""

import argparse
import json
import pathlib

from tokenizers import Tokenizer
from tokenizers import decoders
from tokenizers import models
from tokenizers import normalizers
from tokenizers import pre_tokenizers
from tokenizers import processors
from tokenizers import trainers

REPO = pathlib.Path(__file__).resolve().parents[1]

CORPUS = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat and a dog met on the mat",
    "summarize the following post in one sentence",
    "the model learns to end its summary with an end of sequence token",
    "padding is not the same as the end of a sequence",
    "reward models score a prompt and a completion",
    "the policy samples a completion and the reward model scores it",
    "a reference policy keeps the new policy close to the old one",
    "tokens tokens tokens everywhere",
]

_META = "\u2581"  # SentencePiece's word-boundary mark, used by Llama 2


def wordlevel() -> Tokenizer:
  words = sorted({w for line in CORPUS for w in line.split()})
  vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
  vocab.update({w: i + 3 for i, w in enumerate(words)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
  return tok


def llama_style() -> Tokenizer:
  specials = ["<unk>", "<s>", "</s>"]
  normalizer = normalizers.Sequence(
      [normalizers.Prepend(_META), normalizers.Replace(" ", _META)])
  # Learn merges on the normalised text (no pre-tokeniser, as Llama 2), then
  # rebuild the model with the byte-fallback tokens placed after the specials.
  trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
  trainer_tok.normalizer = normalizer
  trainer_tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=120, special_tokens=specials, show_progress=False))
  learnt = json.loads(trainer_tok.to_str())["model"]
  vocab = {t: i for i, t in enumerate(specials)}
  for byte in range(256):
    vocab[f"<0x{byte:02X}>"] = len(vocab)
  for token, _ in sorted(learnt["vocab"].items(), key=lambda kv: kv[1]):
    if token not in vocab:
      vocab[token] = len(vocab)
  merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
            for m in learnt["merges"]]
  tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>",
                             byte_fallback=True, fuse_unk=True))
  tok.normalizer = normalizer
  tok.decoder = decoders.Sequence([
      decoders.Replace(_META, " "), decoders.ByteFallback(), decoders.Fuse(),
      decoders.Strip(" ", 1, 0)])
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
  tok.add_special_tokens(specials)
  return tok


LLAMA_STYLE_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                  "normalized": False, "rstrip": False, "single_word": False},
    "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                  "normalized": False, "rstrip": False, "single_word": False},
    "pad_token": None,
    "unk_token": "<unk>",
    "tokenizer_class": "LlamaTokenizer",
}


def neox_style() -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=True)
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=340, special_tokens=["<|endoftext|>", "<|padding|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  return tok


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=str(REPO / "tests/fixtures/tokenizers"))
  out = pathlib.Path(parser.parse_args().out)
  for name, make in (("wordlevel", wordlevel), ("llama_style", llama_style),
                     ("neox_style", neox_style)):
    (out / name).mkdir(parents=True, exist_ok=True)
    make().save(str(out / name / "tokenizer.json"), pretty=False)
  with open(out / "llama_style" / "tokenizer_config.json", "w") as f:
    json.dump(LLAMA_STYLE_CONFIG, f, indent=2)
    f.write("\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()

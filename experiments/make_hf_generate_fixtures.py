"""Makes greedy-generation fixtures for the tiny Hugging Face checkpoints.

For each checkpoint under tests/fixtures/hf/ (made by make_hf_fixtures.py)
this writes `generate.npz` beside it: prompts and the token ids that
transformers' own greedy `generate` (with its KV cache) produces from them.
`tests/test_kv_cache.py` checks that `jaxrlhf.models.sampling` reproduces
them without torch.

Decoder-only prompts are left-padded (transformers derives the rotary
positions from the attention mask, as our sampler does). T5 prompts are
right-padded encoder inputs ending in EOS; transformers' leading decoder
start token is dropped, so the ids are the new tokens only.

The end-of-sequence id is chosen per fixture so that truncation is exercised:
a first generation without any EOS picks a token row 0 emits from its third
step on (one it has not emitted before, not 0), and the
stored generation uses it as `eos_token_id` (rows stop after it; finished
rows are padded with 0, and the output is padded with 0 to max_new_tokens
when every row stops early, which is our sampler's layout). `min_gap` is the
smallest top-1 minus top-2 logit margin along the stored paths: float noise
is far below it, so greedy ids must match exactly. (t5_relu_tied's random
tied embedding makes 0 its greedy token at every step: a weak but valid
check, its EOS never occurs.)

Needs torch and transformers (not dependencies of the library):

  python experiments/make_hf_generate_fixtures.py [--root tests/fixtures/hf]
"""

import argparse
import pathlib

import numpy as np
import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parents[1]
DECODER_ONLY = ("llama_gqa", "llama_tied", "pythia", "neox_sequential")
ENCODER_DECODER = ("t5_gated", "t5_relu_tied")
MAX_NEW_TOKENS = 8
SEED = 4321


def _decoder_prompts(rng, vocab):
  """3 left-padded rows of width 6 with 6, 4 and 2 real tokens."""
  tokens = rng.integers(3, vocab, size=(3, 6)).astype(np.int32)
  mask = np.ones((3, 6), np.int32)
  mask[1, :2] = 0
  mask[2, :4] = 0
  return np.where(mask == 1, tokens, 0).astype(np.int32), mask


def _encoder_prompts(rng, vocab):
  """3 right-padded encoder rows of width 7 ending in EOS (1)."""
  lengths = (7, 4, 2)
  tokens = np.zeros((3, 7), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, :n - 1] = rng.integers(3, vocab, size=n - 1)
    tokens[i, n - 1] = 1
  return tokens


def _generate(model, inputs, eos_id, is_encoder_decoder, use_cache=True):
  # generate() fills unset options from the model's own generation config
  # (its eos id among them), so that one is replaced too.
  model.generation_config.eos_token_id = eos_id
  config = transformers.GenerationConfig(
      do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS,
      eos_token_id=eos_id, pad_token_id=0,
      decoder_start_token_id=0 if is_encoder_decoder else None,
      output_scores=True, return_dict_in_generate=True, use_cache=use_cache)
  with torch.no_grad():
    out = model.generate(**inputs, generation_config=config)
  ids = out.sequences.numpy()
  if is_encoder_decoder:
    ids = ids[:, 1:]  # the decoder start token
  else:
    ids = ids[:, inputs["input_ids"].shape[1]:]
  ids = np.pad(ids, ((0, 0), (0, MAX_NEW_TOKENS - ids.shape[1])))
  scores = torch.stack(out.scores, 1).float().numpy()  # [batch, steps, vocab]
  top2 = np.sort(scores, axis=-1)[..., -2:]
  gaps = top2[..., 1] - top2[..., 0]
  # Only steps where the row was still generating decide tokens.
  live = np.ones(gaps.shape, bool)
  if eos_id is not None:
    ended = np.cumsum(ids[:, :gaps.shape[1]] == eos_id, axis=1)
    live = (ended - (ids[:, :gaps.shape[1]] == eos_id)) == 0
  return ids.astype(np.int32), float(gaps[live].min())


def make(name, root, rng):
  path = root / name
  model_cls = (transformers.T5ForConditionalGeneration
               if name in ENCODER_DECODER else transformers.AutoModelForCausalLM)
  model = model_cls.from_pretrained(path, attn_implementation="eager")
  model.eval()
  vocab = model.config.vocab_size
  is_encdec = name in ENCODER_DECODER
  if is_encdec:
    enc = _encoder_prompts(rng, vocab)
    inputs = {"input_ids": torch.from_numpy(enc).long(),
              "attention_mask": torch.from_numpy(enc > 0).long()}
    arrays = {"encoder_input_tokens": enc}
  else:
    tokens, mask = _decoder_prompts(rng, vocab)
    inputs = {"input_ids": torch.from_numpy(tokens).long(),
              "attention_mask": torch.from_numpy(mask).long()}
    arrays = {"prompt_tokens": tokens, "prompt_attention_mask": mask}
  # transformers 5.23 sizes T5's decoder KV cache by the encoder's layer
  # count (IndexError when the decoder is deeper), so such a model generates
  # without its cache (the same greedy ids, recomputed each step).
  use_cache = not is_encdec or (model.config.num_decoder_layers
                                <= model.config.num_layers)
  # A first generation that never stops picks an EOS id that truncates.
  free, _ = _generate(model, inputs, None, is_encdec, use_cache)
  eos_id = int(free[0, 2]) or 1  # never the padding id 0
  for j in range(2, MAX_NEW_TOKENS - 1):  # row 0 should stop mid-way
    if free[0, j] not in free[0, :j] and free[0, j] != 0:
      eos_id = int(free[0, j])
      break
  ids, min_gap = _generate(model, inputs, eos_id, is_encdec, use_cache)
  # The stopped generation is the free one cut after its first EOS.
  is_eos = free == eos_id
  after = (np.cumsum(is_eos, axis=1) - is_eos) > 0
  assert np.array_equal(ids, np.where(after, 0, free)), (ids, free)
  np.savez(path / "generate.npz", generated=ids, eos_id=np.int32(eos_id),
           max_new_tokens=np.int32(MAX_NEW_TOKENS),
           min_gap=np.float32(min_gap), **arrays)
  print(f"{name}: eos {eos_id}, min gap {min_gap:.3f}\n{ids}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=str(REPO / "tests" / "fixtures" / "hf"))
  args = parser.parse_args()
  torch.manual_seed(SEED)
  root = pathlib.Path(args.root)
  for i, name in enumerate(DECODER_ONLY + ENCODER_DECODER):
    make(name, root, np.random.default_rng(SEED + i))


if __name__ == "__main__":
  main()

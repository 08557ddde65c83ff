"""Makes the tiny Gemma 2 parity fixture under tests/fixtures/hf/gemma2/.

A randomly initialised `transformers` Gemma2ForCausalLM (4 layers: two
local/global pairs; a sliding window of 4 positions, shorter than the
inputs, and soft caps small enough that they bend the logits), saved with
`save_pretrained`, with `expected.npz` (the logits transformers computes for
fixed left- and right-padded inputs) and `generate.npz` (its greedy
`generate`, with an EOS that stops a row), made by the same code as the other
families' fixtures (make_hf_fixtures.py, make_hf_generate_fixtures.py).
tests/test_gemma.py checks both without torch.

Needs torch and transformers (not dependencies of the library):

  python experiments/make_gemma_fixtures.py [--root tests/fixtures/hf]
"""

import argparse
import pathlib

import numpy as np
import torch
import transformers

import make_hf_fixtures
import make_hf_generate_fixtures

NAME = "gemma2"
SEED = 2468


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=str(make_hf_fixtures.REPO / "tests"
                                            / "fixtures" / "hf"))
  args = parser.parse_args()
  torch.manual_seed(SEED)
  out = pathlib.Path(args.root) / NAME
  out.mkdir(parents=True, exist_ok=True)
  config = transformers.Gemma2Config(
      vocab_size=make_hf_fixtures.VOCAB, hidden_size=32,
      intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=6,
      sliding_window=4, attn_logit_softcapping=2.0,
      final_logit_softcapping=5.0, max_position_embeddings=64,
      rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
      attn_implementation="eager")
  model = transformers.Gemma2ForCausalLM(config)
  make_hf_fixtures._randomise(model, SEED)  # pylint: disable=protected-access
  with torch.no_grad():
    # A smaller (tied) embedding: at N(0, 1) times sqrt(32) it dominates the
    # residual stream and the model only repeats its input.
    model.model.embed_tokens.weight.mul_(0.3)
  make_hf_fixtures._save_decoder_fixture(  # pylint: disable=protected-access
      model, out, np.random.default_rng(SEED))
  make_hf_generate_fixtures.make(NAME, pathlib.Path(args.root),
                                 np.random.default_rng(SEED + 1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()

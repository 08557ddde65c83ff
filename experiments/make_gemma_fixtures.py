"""Makes the tiny Gemma 2 parity fixtures under tests/fixtures/hf/.

gemma2/: a randomly initialised `transformers` Gemma2ForCausalLM (4 layers:
local and global alternating; a sliding window of 4 positions, shorter than
the inputs, and soft caps small enough that they bend the logits).
gemma2_odd/: 3 layers whose `layer_types` are not the alternating default
(local, local, global): an odd count, which transformers accepts, and a
pattern read from the config. Each is saved with `save_pretrained`, with
`expected.npz` (the logits transformers computes for fixed left- and
right-padded inputs) and `generate.npz` (its greedy `generate`, with an EOS
that stops a row, and which a window too wide to matter would change),
made by the same code as the other families' fixtures
(make_hf_fixtures.py, make_hf_generate_fixtures.py). tests/test_gemma.py
checks both without torch.

Needs torch and transformers (not dependencies of the library):

  python experiments/make_gemma_fixtures.py [--root tests/fixtures/hf] \
      [--only gemma2_odd]
"""

import argparse
import pathlib

import numpy as np
import torch
import transformers

import make_family_fixtures
import make_hf_fixtures
import make_hf_generate_fixtures

# name -> (seed, Gemma2Config fields beyond the shared ones).
FIXTURES = {
    "gemma2": (2468, dict(num_hidden_layers=4, sliding_window=4)),
    "gemma2_odd": (5555, dict(
        num_hidden_layers=3, sliding_window=3,
        layer_types=["sliding_attention", "sliding_attention",
                     "full_attention"])),
}


def make(name, root: pathlib.Path):
  seed, fields = FIXTURES[name]
  torch.manual_seed(seed)
  out = root / name
  out.mkdir(parents=True, exist_ok=True)
  config = transformers.Gemma2Config(
      vocab_size=make_hf_fixtures.VOCAB, hidden_size=32,
      intermediate_size=48, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=6,
      attn_logit_softcapping=2.0,
      final_logit_softcapping=5.0, max_position_embeddings=64,
      rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
      attn_implementation="eager", **fields)
  model = transformers.Gemma2ForCausalLM(config)
  make_hf_fixtures._randomise(model, seed)  # pylint: disable=protected-access
  with torch.no_grad():
    # A smaller (tied) embedding: at N(0, 1) times sqrt(32) it dominates the
    # residual stream and the model only repeats its input.
    model.model.embed_tokens.weight.mul_(0.3)
  make_hf_fixtures._save_decoder_fixture(  # pylint: disable=protected-access
      model, out, np.random.default_rng(seed))
  make_hf_generate_fixtures.make(name, root, np.random.default_rng(seed + 1))
  make_family_fixtures.check_window_matters(name, root)
  print(f"wrote {out}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=str(make_hf_fixtures.REPO / "tests"
                                            / "fixtures" / "hf"))
  parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES))
  args = parser.parse_args()
  for name in FIXTURES:
    if not args.only or name in args.only:
      make(name, pathlib.Path(args.root))


if __name__ == "__main__":
  main()

"""Run by test_models_sharded.py on 8 simulated CPU devices.

Loads T5 (the t5x encdec fixture) and Llama (the llama_gqa HF fixture) once
on the default device and once sharded on a 4x2 (data x model) mesh by
their logical axis names, computes logits and greedy KV-cache decodes both
ways, and prints one JSON line with the differences and the
shardings seen.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python tests/models_sharded_check.py tests/fixtures
"""

import json
import pathlib
import sys

import flax.linen as nn
import jax
import numpy as np

from jaxrlhf import sharding
from jaxrlhf.models import from_pretrained
from jaxrlhf.models import layers
from jaxrlhf.models import sampling

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
NEW_TOKENS = 8


def _spec(array):
  return [None if a is None else str(a) for a in array.sharding.spec]


def _compare(single, sharded):
  return float(np.max(np.abs(np.asarray(single, np.float32)
                             - np.asarray(sharded, np.float32))))


def check(path, make_inputs, forward, sample, mesh, rules, kernel_path):
  out = {}
  module, _, params = from_pretrained(path)
  inputs = make_inputs()
  logits = jax.jit(forward, static_argnums=0)(module, params, *inputs)
  greedy = sample(module, params, *inputs, greedy=True)

  module, _, sharded = from_pretrained(path, mesh=mesh, rules=rules)
  kernel = sharded
  for key in kernel_path:
    kernel = kernel[key]
  out["kernel_spec"] = _spec(kernel)
  out["kernel_devices"] = len(kernel.sharding.device_set)
  batch = sharding.batch_sharding(mesh, rules, 2)
  sharded_inputs = [jax.device_put(x, batch) for x in inputs]
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    logits_8 = jax.jit(forward, static_argnums=0)(module, sharded,
                                                  *sharded_inputs)
    greedy_8 = sample(module, sharded, *sharded_inputs, greedy=True)
  out["logits_spec"] = _spec(logits_8)
  out["tokens_spec"] = _spec(greedy_8.tokens)
  out["logits_diff"] = _compare(logits, logits_8)
  out["greedy_equal"] = bool(np.array_equal(greedy.tokens, greedy_8.tokens))
  out["greedy_logprob_diff"] = _compare(greedy.logprobs, greedy_8.logprobs)
  out["greedy_has_eos"] = np.asarray(greedy.has_eos).tolist()
  out["greedy_tokens"] = np.asarray(greedy.tokens).tolist()
  return out


def main():
  fixtures = pathlib.Path(sys.argv[1])
  mesh = sharding.create_mesh((4, 2), ("data", "model"))
  rules = sharding.STANDARD_RULES
  results = {"devices": jax.device_count()}

  encdec = fixtures / "t5x" / "encdec"
  e = np.load(encdec / "expected.npz")
  # 4 rows (the data axis): the fixture's 3 prompts and the first again.
  prompts = np.concatenate([e["encoder_input_tokens"],
                            e["encoder_input_tokens"][:1]])
  decoder_inputs = np.concatenate([e["decoder_input_tokens"],
                                   e["decoder_input_tokens"][:1]])
  results["t5"] = check(
      encdec / "checkpoint_3", lambda: (prompts,),
      lambda m, p, x: m.apply({"params": p}, x, decoder_inputs),
      lambda m, p, x, **kw: sampling.sample_encoder_decoder(
          m, p, x, jax.random.PRNGKey(1), NEW_TOKENS, **kw),
      mesh, rules, ("decoder", "logits_dense", "kernel"))
  results["t5_expected_greedy"] = e["predict_greedy"].tolist()

  tokens = np.array([[5, 9, 12, 7, 3, 8], [0, 0, 4, 4, 11, 6],
                     [0, 0, 0, 0, 13, 2], [0, 17, 18, 19, 20, 21]], np.int32)
  mask = (tokens > 0).astype(np.int32)

  def llama_forward(m, p, x, a):
    return m.apply({"params": p}, x, layers.positions_from_mask(a), a)

  results["llama"] = check(
      HF_FIXTURES / "llama_gqa", lambda: (tokens, mask), llama_forward,
      lambda m, p, x, a, **kw: sampling.sample_decoder_only(
          m, p, x, a, jax.random.PRNGKey(2), NEW_TOKENS, eos_id=47, **kw),
      mesh, rules, ("decoder", "layers_0", "mlp", "wi_0", "kernel"))
  print("RESULT " + json.dumps(results))


if __name__ == "__main__":
  main()

"""A simple greedy decoder for encoder-decoder models.

Each step re-runs the decoder over the whole (short) prefix; the KV-cache
sampler of jaxrlhf.models supersedes it for long outputs. The output format is
t5x's: no BOS, EOS kept, zeros after EOS, a row without EOS fills the length.
"""

import jax
import jax.numpy as jnp


def greedy_decode(model, params, encoder_input_tokens, max_length: int,
                  eos_id: int = 1):
  """Argmax decoding.

  Args:
    model: a jaxrlhf.models.t5.T5 module.
    params: its parameters.
    encoder_input_tokens: [batch, enc_len] int32.
    max_length: number of tokens to produce.
  Returns:
    (tokens [batch, max_length] int32, finished [batch] bool: EOS produced).
  """
  batch = encoder_input_tokens.shape[0]
  variables = {"params": params}
  encoded = model.apply(variables, encoder_input_tokens, method=model.encode)
  positions = jnp.arange(max_length)[None, :]

  def step(t, carry):
    decoder_inputs, out, done = carry
    logits = model.apply(variables, encoded, encoder_input_tokens,
                         decoder_inputs, method=model.decode)
    token = jnp.argmax(logits[:, t], axis=-1).astype(jnp.int32)
    token = jnp.where(done, 0, token)
    out = jnp.where(positions == t, token[:, None], out)
    decoder_inputs = jnp.where(positions == t + 1, token[:, None], decoder_inputs)
    return decoder_inputs, out, done | (token == eos_id)

  zeros = jnp.zeros((batch, max_length), jnp.int32)
  _, tokens, finished = jax.lax.fori_loop(
      0, max_length, step, (zeros, zeros, jnp.zeros((batch,), bool)))
  return tokens, finished

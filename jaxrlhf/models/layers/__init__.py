"""The building blocks of the model families, one concern per module.

  linears          DenseGeneral, the kernel initialisers, Embed, OutputDense,
                   Mlp and its activations
  normalizations   RMSNorm, LayerNorm
  rotary           rotary position embeddings and their scaling
  attentions       the attention core (CausalSegments, attend) and Attention
  kv_cache         the KV cache of incremental decoding
  t5_attention     T5's relative-position bias and attention
  param_recording  parameters cast and projections joined for a decode loop
  decoders         the layer stack and the decoder-only model (CausalLM)

Everything is Flax Linen with float32 parameters, a configurable compute
`dtype`, logical axis names on every parameter and logical constraints on
the large activations. Logical axis names used: batch, length, embed, mlp,
heads, kv_heads, kv, vocab, layers. `kv_heads` is the key/value head axis
of grouped-query attention; it has its own name because it is often smaller
than the model axis of a mesh that shards `heads` (Llama 3 8B has 8
key/value heads and 32 query heads), so a sharding plan may replicate it or
shard it differently.
"""

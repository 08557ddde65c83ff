"""Models: the model families and what reads and writes them.

  registry.build_model(config.model, task_vocab_size) -> (module, config)
  loading.from_pretrained(path, mesh=..., rules=...)
      -> (module, model_config, params)
  loading.export_hf(module_or_config, params, path)

The families are registered in `registry` (`FAMILIES`, `family_of`), each
one module ending in a `family.Family` value; their building blocks are in
`layers/`. Sampling with a KV cache is in `sampling`, the scoring API in
`scoring`.
"""

"""The logical-axis rule tables a config names
(`config.sharding.logical_axis_rules`).

Plain tuples, with no JAX: config files (`jaxrlhf.presets`, `configs/`) read
them, and the command line loads a config file before it imports JAX to
check its overrides (`jaxrlhf.cli.early_unknown_field`). What applies them
to meshes and arrays is `jaxrlhf.sharding`.
"""

# t5x's standard rules for a (data, model) mesh: data parallel over batch,
# tensor parallel over the wide dimensions.
STANDARD_RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("joined_kv", "model"),
    ("kv", None),
    ("embed", None),
    ("length", None),
    ("layers", None),
    ("relpos_buckets", None),
    ("expert", None),
)


# The standard rules with every parameter's embedding dimension also split
# over the data axis (fully sharded data parallelism, ZeRO-3): a parameter,
# its gradient and its optimizer state are held once per data-parallel group
# instead of on every data shard, and XLA gathers each layer's weights when
# the layer runs. Activations are unchanged: their batch dimension takes
# the data axis first (a mesh axis splits one dimension of an array).
FULLY_SHARDED_RULES = tuple(
    (name, "data") if name == "embed" else (name, axes)
    for name, axes in STANDARD_RULES)

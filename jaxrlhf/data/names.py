"""Names of the data floor that the config and the algorithms use without
reading data: the choices of data config fields, the feature names of a
batch and the built-in tasks' names.

The config (`jaxrlhf.defaults`, each algorithm's config groups) loads this
module, so it imports no data stack (TensorFlow, seqio): a config error or
`--help` stays quick. The modules that read data (`file_sources`,
`feature_converters`) take their names from here.
"""

# What a file source does with a malformed row (`data.files.on_bad_row`).
ON_BAD_ROW = ("raise", "skip_and_report")

# Suffixes of a completion's features in a batch, per architecture: the
# encoder-decoder layout ("<completion>_decoder_target_tokens", ...) and the
# decoder-only one ("<completion>_tokens", ...) (`feature_converters`).
ENCDEC_SUFFIXES = ("decoder_target_tokens", "decoder_input_tokens",
                   "decoder_loss_weights")
DECODER_SUFFIXES = ("tokens", "loss_weights", "positions", "attention_mask")

# The built-in tasks (`tasks` registers them): the synthetic summarisation
# task, the same with prompts of three difficulty levels (synthetic.py's
# graded variant; same vocabulary and gold reward), and sums with an exact
# answer (synthetic_arithmetic.py).
SYNTHETIC_SUMMARIZE = "synthetic_summarize"
SYNTHETIC_SUMMARIZE_GRADED = "synthetic_summarize_graded"
SYNTHETIC_ARITHMETIC = "synthetic_arithmetic"

# How a TL;DR query ends: no trailing space ("N+ implementation details",
# detail 2). The TL;DR layouts write it (`file_layouts`); the TL;DR PPO
# config keeps it when it cuts a long query (`online.prompt_suffix`).
TLDR_QUERY_SUFFIX = "\n\nTL;DR:"

"""TL;DR SFT on Pythia, as "The N+ implementation details of RLHF with PPO"
ran it (Table 3): one epoch of the 116,722 filtered Reddit TL;DR
demonstrations, AdamW (eps 1e-5, lr 3e-6), cosine schedule, batch 128,
from the pretrained Pythia checkpoint.

  python -m jaxrlhf.main --config=configs/tldr_pythia_sft.py:pythia-1b \
      --workdir=/runs/tldr_sft \
      --config.init.policy_checkpoint=/models/pythia-1b-deduped \
      --config.data.files.vocabulary=/models/pythia-1b-deduped/tokenizer.json \
      --config.data.files.train=/data/tldr_sft/train.jsonl \
      --config.data.files.validation=/data/tldr_sft/validation.jsonl

The data (layout "tldr_sft", rows {"subreddit", "title", "post",
"summary"}): each post becomes the query "SUBREDDIT: r/...\\n\\nTITLE: ...
\\n\\nPOST: ...\\n\\nTL;DR:" (no trailing space), its last paragraphs dropped
until it fits 512 tokens (detail 2); the summary gets a leading space and
the EOS (detail 3) and must fit 53 tokens (detail 4; longer ones are
reported and skipped). init.policy_checkpoint is a Hugging Face folder of
Pythia (config.json + model.safetensors). Evaluation: held-out loss and
token accuracy on data.files.validation. Other sizes: `:pythia-2.8b`,
`:pythia-6.9b`. Settings shared by the TL;DR stages:
jaxrlhf.presets.tldr_pythia.
"""

from jaxrlhf import defaults
from jaxrlhf import presets


def get_config(size: str = "pythia-1b"):
  c = presets.tldr_pythia("sft", size, learning_rate=3e-6,
                          schedule="cosine", batch_size=128,
                          episodes=116_722)
  # A local Hugging Face folder (config.json + model.safetensors).
  c.init.policy_checkpoint = f"/{defaults.PLACEHOLDER}/{size}-deduped"
  presets.tldr_data(c, "sft")
  c.eval.num_examples = 1000
  return c

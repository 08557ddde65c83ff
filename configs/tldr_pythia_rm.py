"""The TL;DR reward model on Pythia, as "The N+ implementation details of
RLHF with PPO" trained it (Table 4, details 10-16): one epoch of the 92,858
OpenAI summarize_from_feedback comparisons, AdamW (eps 1e-5, lr 3e-6),
cosine schedule, batch 64, from the SFT run; at the end the head's bias
makes the SFT reference summaries score mean 0 (detail 15).

  python -m jaxrlhf.main --config=configs/tldr_pythia_rm.py:pythia-1b \
      --workdir=/runs/tldr_rm --config.init.policy_checkpoint=/runs/tldr_sft \
      --config.data.files.vocabulary=/models/pythia-1b-deduped/tokenizer.json \
      --config.data.files.train='/data/comparisons/train/*.json' \
      --config.data.files.validation='/data/comparisons/validation/*.json' \
      --config.reward_model.normalize_files=/data/tldr_sft/train.jsonl

Comparison rows (layout "tldr") give the same queries as the SFT data
(detail 2), completions with a leading space and the EOS of up to 169
tokens (details 3, 4), the annotator's confidence and the annotation batch.
The evaluation scores every validation comparison (the CNN/DM rows, which
have no post, are reported and skipped): accuracy overall, by annotation
batch and by confidence (detail 16: `eval/accuracy_batch<b>`,
`eval/accuracy_confidence<c>`), loss, margin and calibration. Every
comparison counts once, as in the paper's reward-model loss (its eq. 1, an
expectation over the comparisons; the InstructGPT per-prompt weights are
off).
"""

from jaxrlhf import presets


def get_config(size: str = "pythia-1b"):
  c = presets.tldr_pythia("reward_model", size, learning_rate=3e-6,
                          schedule="cosine", batch_size=64, episodes=92_858)
  bucket = presets.TLDR_BUCKET
  c.init.policy_checkpoint = f"{bucket}/tldr_sft"
  presets.tldr_data(c, "comparisons")
  c.reward_model.weight_prompts_equally = False
  c.reward_model.normalize_on_task = "tldr_sft_demonstrations"
  c.reward_model.normalize_files = f"{bucket}/tldr_sft/train.jsonl"
  c.reward_model.normalize_layout = "tldr_sft"
  c.reward_model.normalize_split = "train"
  c.eval.num_examples = 100_000  # the whole validation split
  c.eval.batch_size = 64
  return c

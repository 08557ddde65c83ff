"""The DRO paper's headline run: DRO-V with a T5 1.1 XL policy and value on
UltraFeedback, 20,000 steps on a TPU v5e 4x8 slice (32 chips).

  python -m jaxrlhf.main --config=configs/dro_t5xl.py --workdir=gs://.../dro_xl \
      --config.init.policy_checkpoint=gs://.../sft_xl/checkpoint_N \
      --config.data.files.train='gs://.../ultrafeedback/*.parquet' \
      --config.eval.judge_checkpoint=gs://.../ultrafeedback_rm --distributed

Settings: see jaxrlhf.presets.ultrafeedback_offline; the paper's evaluation
and checkpoint selection (every 2,000 steps, side by side against SFT on
held-out prompts in 5 folds of 1,000, the best checkpoint kept in
<workdir>/best and reported on 5 folds of 1,000 test prompts): see
jaxrlhf.presets.dro_paper_evaluation (point eval.judge_checkpoint at a
reward model run, or plug in an LLM judge).
"""

from jaxrlhf import presets


def get_config():
  c = presets.ultrafeedback_offline("dro_v", "xl", mesh_shape=(4, 8),
                                    num_steps=20_000)
  presets.dro_paper_evaluation(c)
  return c

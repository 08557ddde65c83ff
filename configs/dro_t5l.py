"""DRO-V with a T5 1.1 Large policy and value on UltraFeedback, 40,000 steps
on a TPU v5e 4x4 slice (16 chips), as in the DRO paper.

Settings: see jaxrlhf.presets.ultrafeedback_offline; the paper's evaluation
and checkpoint selection (every 2,000 steps, side by side against SFT on
held-out prompts in 5 folds of 1,000, the best checkpoint kept in
<workdir>/best and reported on 5 folds of 1,000 test prompts): see
jaxrlhf.presets.dro_paper_evaluation (point eval.judge_checkpoint at a
reward model run, or plug in an LLM judge).
"""

from jaxrlhf import presets


def get_config():
  c = presets.ultrafeedback_offline("dro_v", "large", mesh_shape=(4, 4),
                                    num_steps=40_000)
  presets.dro_paper_evaluation(c)
  return c

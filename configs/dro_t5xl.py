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

With `--config=configs/dro_t5xl.py:lora` the policy and the value network
are rank-16 LoRA adapters (alpha 32, every attention and MLP projection)
on one frozen T5 1.1 XL, the SFT checkpoint: the reference is that base
with the adapters off and the value network's backbone is the same base
with adapters of its own (jaxrlhf/algorithms/lora_state.py), so one copy
of the 3B weights is held instead of three. Adafactor then steps the
adapters without its parameter-scale factor (B starts at 0, which it would
scale to 1e-3 of the learning rate). It is laid out for a v5e 2x2 slice
(4 chips, mesh 1 x 4, the batch in 16 micro-batches) against the full
run's 4x8: `python -m jaxrlhf.plan --config=configs/dro_t5xl.py:lora
--topology=v5e:2x2` gives 12.4 GiB of a chip's 16
(experiments/results/plans/dro_t5xl_lora.json), 3.6 free.
"""

from jaxrlhf import presets


def get_config(variant: str = ""):
  if variant not in ("", "lora"):
    raise ValueError(f"--config=configs/dro_t5xl.py:{variant}: the variant "
                     "is '' (full fine-tuning) or 'lora'.")
  lora = variant == "lora"
  c = presets.ultrafeedback_offline("dro_v", "xl",
                                    mesh_shape=(1, 4) if lora else (4, 8),
                                    num_steps=20_000)
  presets.dro_paper_evaluation(c)
  if lora:
    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.optimizer.multiply_by_parameter_scale = False
    # 4 chips: a quarter of the full run's, with the batch in 8 times as
    # many parts (module docstring).
    c.train.num_microbatches = 16
  return c

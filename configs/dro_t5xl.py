"""The DRO paper's headline run: DRO-V with a T5 1.1 XL policy and value on
UltraFeedback, 20,000 steps on a TPU v5e 4x8 slice (32 chips).

  python -m jaxrlhf.main --config=configs/dro_t5xl.py --workdir=gs://.../dro_xl \
      --config.init.policy_checkpoint=gs://.../sft_xl/checkpoint_N \
      --config.data.files.train='gs://.../ultrafeedback/*.parquet' --distributed

Settings: see jaxrlhf.presets.ultrafeedback_offline.
"""

from jaxrlhf import presets


def get_config():
  return presets.ultrafeedback_offline("dro_v", "xl", mesh_shape=(4, 8),
                                       num_steps=20_000)

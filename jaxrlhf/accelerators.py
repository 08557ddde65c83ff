"""What each accelerator chip can do: memory, peak bf16 FLOP/s, bandwidth.

One table for every figure the project derives from a chip's data sheet:
the ahead-of-time plan (`jaxrlhf.plan`: does a step fit, its lower-bound
step time), MFU in the benchmarks and the HBM-bandwidth bound of sampling
(`experiments/`). Keys are JAX's `device.device_kind` strings.

Sources (vendors' published figures, dense bf16 without sparsity):
  TPU v4, v5e, v5p, v6e: Google Cloud TPU documentation, "System
    architecture" pages of each version (HBM per chip, peak bf16 TFLOP/s,
    HBM bandwidth).
  H100 SXM5, H100 PCIe, H200, A100 80GB SXM: NVIDIA's data sheets.
"""

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Chip:
  """One chip's data-sheet figures.

  Attributes:
    name: the usual name ("TPU v5e").
    hbm_gib: high-bandwidth memory per chip, GiB.
    peak_bf16_tflops: dense bf16 matmul peak, TFLOP/s.
    hbm_gbps: memory bandwidth, GB/s.
  """
  name: str
  hbm_gib: float
  peak_bf16_tflops: float
  hbm_gbps: float


CHIPS = {
    "TPU v4": Chip("TPU v4", 32, 275, 1200),
    "TPU v5 lite": Chip("TPU v5e", 16, 197, 819),
    "TPU v5": Chip("TPU v5p", 95, 459, 2765),
    "TPU v6 lite": Chip("TPU v6e", 32, 918, 1640),
    "NVIDIA H100 80GB HBM3": Chip("H100 SXM5", 80, 989, 3350),
    "NVIDIA H100 PCIe": Chip("H100 PCIe", 80, 756, 2000),
    "NVIDIA H200": Chip("H200", 141, 989, 4800),
    "NVIDIA A100-SXM4-80GB": Chip("A100 80GB SXM", 80, 312, 2039),
}


def chip(device_kind: str) -> Optional[Chip]:
  """The data sheet of a `device.device_kind`, or None (a CPU, or a chip
  not in the table)."""
  if device_kind in CHIPS:
    return CHIPS[device_kind]
  # Some drivers report the kind without the vendor's prefix.
  for kind, spec in CHIPS.items():
    if kind.endswith(device_kind) or device_kind.endswith(kind):
      return spec
  return None

"""Device profiles: the numbers of a device the step-cost model needs.

The shipped GPU profiles take peak figures from the vendors' public spec sheets (dense
BF16 tensor-core FLOP/s, i.e. the figure WITHOUT 2:4 sparsity, which the sheets print
twice as large; HBM bandwidth; memory in decimal GB as printed) and stay
`calibrated=False` until a measured run fits them (`kvserve calibrate` writes a JSON
profile with `calibrated: true` and the fit error).

Default efficiencies for the uncalibrated GPU profiles, and why:
- bandwidth_efficiency 0.8: memory-bound decode kernels (weight GEMV, paged attention)
  sustain about 80-90% of peak HBM bandwidth in published microbenchmarks and serving
  engines' decode rooflines; 0.8 keeps the lower end since a step also has launch gaps.
- flops_efficiency 0.6: large BF16 GEMMs reach 70-80% of the dense peak with cuBLAS, but
  a prefill step also runs attention, norms and activations below peak; 0.6 is the
  usual end-to-end model-FLOP utilisation of prefill in serving engines.
- step_overhead_s 1 ms: per-step host work of an engine of this design (schedule,
  build inputs, one host sync for the sampled ids, stream outputs) with decode CUDA graphs.
- per_seq_overhead_s 20 us: per-sequence host work in a step (block table row, sampling
  parameters, output update).
These are stated assumptions, not measurements; a fitted profile replaces all four.

KV tiers (cluster/sim/tiers.py) and LoRA adapter copies (worker/lora/cost.py) also need the
links below the device, peak figures again:
- host_link_bandwidth: the device's host link, one direction (PCIe Gen5 x16: 32 GT/s x 16
  lanes x 128b/130b = 63 GB/s; Gen4 x16 half that, the default of a profile that says none).
- disk_read_bandwidth: one local NVMe data drive's sequential read (a Gen4 x4 U.2 data-centre
  SSD such as the Samsung PM9A3 reads 6.9 GB/s; NVIDIA's DGX H100/H200 carry 8 such 3.84 TB
  data drives for 8 GPUs: one drive per GPU).
- link_efficiency 0.8: pinned-memory copies over PCIe and large sequential NVMe reads reach
  80-90% of the link's peak in published measurements (nvbandwidth, fio).
A disk_read_bandwidth of 0 means the profile does not model a disk: the simulator then
refuses the disk tier.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

DEFAULT_FLOPS_EFFICIENCY = 0.6
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
DEFAULT_STEP_OVERHEAD_S = 1e-3
DEFAULT_PER_SEQ_OVERHEAD_S = 20e-6
DEFAULT_LINK_EFFICIENCY = 0.8
_PCIE_GEN5_X16 = 32e9 * 16 * 128 / 130 / 8  # bytes/s, one direction
_PCIE_GEN4_X16 = _PCIE_GEN5_X16 / 2
_NVME_GEN4_READ = 6.9e9  # bytes/s: Samsung PM9A3 U.2 datasheet, sequential read


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hbm_bandwidth: float  # bytes/s, peak
    peak_flops: float  # FLOP/s, dense, in the serving dtype
    memory_bytes: int
    flops_efficiency: float = DEFAULT_FLOPS_EFFICIENCY
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    per_seq_overhead_s: float = DEFAULT_PER_SEQ_OVERHEAD_S
    # Host work per token of the step (building inputs, elementwise ops a roofline of the
    # matmuls and attention does not see). 0 on a GPU; a CPU fit finds it.
    per_token_overhead_s: float = 0.0
    # Host work per prompt-chunk row (a row of more than one new token) beyond
    # per_seq_overhead_s. 0 on a GPU (varlen kernels take every row in one call); the CPU
    # backend runs one attention call per prompt row per layer (mask built, context
    # gathered) but one per decode group, so its prompt rows cost more than its decode
    # rows, and one per-row overhead fitted over both overprices decode-only steps while it
    # underprices steps that carry a prompt. A CPU fit finds it.
    per_prompt_seq_overhead_s: float = 0.0
    # What a decode-only step right after a step with prompt rows takes beyond its own
    # cost: a prompt chunk's activations push the weights out of a CPU's caches, and the
    # decode after it reads them from memory again. 0 on a GPU (weights never sit in its
    # caches between steps); a CPU fit finds it from the decode after each mixed point.
    after_prompt_overhead_s: float = 0.0
    # Attention's own share of the FLOP peak (None: flops_efficiency). A GPU's fused
    # attention kernels run near the GEMMs' rate; the CPU backend's unfused attention
    # (scores materialised, a mask, paged KV gathered) runs far below it, so one shared
    # efficiency cannot fit prefill chunks of different sizes.
    attention_flops_efficiency: float | None = None
    # The engine's attention backend pads decodes to their group's longest context
    # (worker/runner/decode_groups.py: the CPU torch backend; GPU varlen kernels do not). Uniform
    # calibration batches never show it; a run's mixed contexts do: unpriced, the padding
    # makes real decode steps slower than modelled, and TTFTs higher with them.
    padded_decode_attention: bool = False
    # Links below the device (KV tiers, LoRA copies), bytes/s peak; a disk of 0: not modelled.
    host_link_bandwidth: float = _PCIE_GEN4_X16
    disk_read_bandwidth: float = 0.0
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY
    calibrated: bool = False
    source: str = ""
    # A fitted profile says what it was fitted on and how well (calibrate writes these).
    fit: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.hbm_bandwidth <= 0 or self.peak_flops <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"device profile {self.name!r}: bandwidth, FLOP/s and memory must be > 0")
        if not (0 < self.flops_efficiency <= 1 and 0 < self.bandwidth_efficiency <= 1
                and 0 < self.attention_efficiency <= 1):
            raise ValueError(f"device profile {self.name!r}: efficiencies must be in (0, 1]")
        if min(self.step_overhead_s, self.per_seq_overhead_s, self.per_token_overhead_s,
               self.per_prompt_seq_overhead_s, self.after_prompt_overhead_s) < 0:
            raise ValueError(f"device profile {self.name!r}: overheads must be >= 0")
        if self.host_link_bandwidth <= 0 or self.disk_read_bandwidth < 0 or not 0 < self.link_efficiency <= 1:
            raise ValueError(f"device profile {self.name!r}: host_link_bandwidth must be > 0, "
                             "disk_read_bandwidth >= 0, link_efficiency in (0, 1]")

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.flops_efficiency

    @property
    def attention_efficiency(self) -> float:
        return self.flops_efficiency if self.attention_flops_efficiency is None else self.attention_flops_efficiency

    @property
    def effective_attention_flops(self) -> float:
        return self.peak_flops * self.attention_efficiency

    @property
    def effective_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.bandwidth_efficiency

    @property
    def effective_host_link_bandwidth(self) -> float:
        return self.host_link_bandwidth * self.link_efficiency

    @property
    def effective_disk_read_bandwidth(self) -> float:
        return self.disk_read_bandwidth * self.link_efficiency

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"device profile: unknown keys {unknown} (known: {', '.join(sorted(known))})")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


_GB = 10**9

BUILTIN_PROFILES: dict[str, DeviceProfile] = {
    "h200": DeviceProfile(
        name="h200", hbm_bandwidth=4.8e12, peak_flops=989e12, memory_bytes=141 * _GB,
        host_link_bandwidth=_PCIE_GEN5_X16, disk_read_bandwidth=_NVME_GEN4_READ,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity "
               "(989 dense), 141 GB HBM3e, 4.8 TB/s, PCIe Gen5 x16 (128 GB/s both directions); local NVMe: "
               "one PCIe Gen4 U.2 data drive per GPU as in DGX H200 (8x 3.84 TB), 6.9 GB/s read each",
    ),
    "h100": DeviceProfile(
        name="h100", hbm_bandwidth=3.35e12, peak_flops=989e12, memory_bytes=80 * _GB,
        host_link_bandwidth=_PCIE_GEN5_X16, disk_read_bandwidth=_NVME_GEN4_READ,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity "
               "(989 dense), 80 GB HBM3, 3.35 TB/s, PCIe Gen5 x16; local NVMe: one Gen4 U.2 data drive "
               "per GPU (DGX H100: 8x 3.84 TB), 6.9 GB/s read each",
    ),
    "a100-80gb": DeviceProfile(
        name="a100-80gb", hbm_bandwidth=2.039e12, peak_flops=312e12, memory_bytes=80 * _GB,
        host_link_bandwidth=_PCIE_GEN4_X16, disk_read_bandwidth=_NVME_GEN4_READ,
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOPS dense "
               "(624 with sparsity), 80 GB HBM2e, 2,039 GB/s, PCIe Gen4 x16; local NVMe: one Gen4 U.2 "
               "data drive, 6.9 GB/s read",
    ),
    "l4": DeviceProfile(
        name="l4", hbm_bandwidth=300e9, peak_flops=121e12, memory_bytes=24 * _GB,
        host_link_bandwidth=_PCIE_GEN4_X16, disk_read_bandwidth=_NVME_GEN4_READ,
        source="NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity (121 dense), "
               "24 GB GDDR6, 300 GB/s, PCIe Gen4 x16; local NVMe: one Gen4 U.2 data drive, 6.9 GB/s read",
    ),
}


def profile_names() -> list[str]:
    return sorted({*BUILTIN_PROFILES, *(p.stem for p in PROFILES_DIR.glob("*.json"))})


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in name ("h200"), a shipped JSON profile by name ("cpu-calibrated"), or a
    path to a JSON profile (as `kvserve calibrate` writes)."""
    key = name_or_path.lower()
    if key in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key]
    shipped = PROFILES_DIR / f"{name_or_path}.json"
    path = shipped if shipped.is_file() else Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"device profile {name_or_path!r} is neither a known profile ({', '.join(profile_names())}) "
            f"nor a JSON file"
        )
    try:
        return DeviceProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None

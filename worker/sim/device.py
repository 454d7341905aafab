"""The `device` setting's simulated form, `sim:<profile>`: parsing it, and checking a
device / model_shape pair at the config edge (torch-free and cheap: the profile and
shape files are read, nothing is built)."""
from __future__ import annotations

from worker.costs.profiles import load_profile
from worker.costs.shapes import load_shape

SIM_DEVICE_PREFIX = "sim:"
REAL_DEVICES = ("auto", "cpu", "cuda")


def is_sim_device(device: str) -> bool:
    return device.startswith(SIM_DEVICE_PREFIX)


def parse_sim_device(device: str) -> str | None:
    """"sim:h200" -> "h200"; "sim:/path/p.json" -> the path; any other device -> None."""
    if not is_sim_device(device):
        return None
    profile = device[len(SIM_DEVICE_PREFIX):]
    if not profile:
        raise ValueError("a sim device names a profile: sim:h200, sim:h100, sim:a100-80gb, sim:l4 or sim:/path/profile.json")
    return profile


def check_device(device: str) -> None:
    """Raise ValueError with a readable message for a device that is not one."""
    profile = parse_sim_device(device)
    if profile is None:
        if device not in REAL_DEVICES:
            raise ValueError(f"must be one of {', '.join(REAL_DEVICES)} or sim:<profile>, got {device!r}")
        return
    try:
        load_profile(profile)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(str(e)) from None


def check_model_shape(model_shape: str | None, device: str) -> None:
    """A shape is for a simulated device only, and must load."""
    if model_shape is None:
        return
    if not is_sim_device(device):
        raise ValueError("is only used with a simulated device (device: sim:<profile>)")
    try:
        load_shape(model_shape)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(str(e)) from None

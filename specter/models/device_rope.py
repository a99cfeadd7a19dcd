"""Longrope (Phi-3.5-MoE) with its short/long choice made on the device: no host sync, so a step can be captured.

HF's longrope rotary compares `max(position_ids) + 1` with `original_max_position_embeddings` on the host in
every forward (a sync, and a host-to-device copy of the frequencies), which a CUDA graph cannot capture.
Here both regimes' inverse frequencies and scales live on the device and `torch.where` picks one from the
positions. Which frequencies and scale each regime uses is read off HF's own forward (probed below and
above the switch) and must reproduce it exactly, or nothing is installed.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

SHORT_PROBE = 16  # positions probed in each regime


@dataclass(frozen=True)
class RopeRegime:
    """One side of the switch: the inverse frequencies [D/2] (float32) and the scale of cos and sin."""

    inv_freq: torch.Tensor
    scale: float


def longrope_cos_sin(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: torch.Tensor,
                     switch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] in x's dtype for `position_ids` [B, T]; `inv_freq` [2, D/2] and `scale` [2] hold the
    short (row 0) and long (row 1) regime; the long one applies when max(position_ids) + 1 > `switch`."""
    longer = position_ids.max() + 1 > switch  # [] on the device
    inv = torch.where(longer, inv_freq[1], inv_freq[0])  # [D/2]
    factor = torch.where(longer, scale[1], scale[0])  # []
    inv_expanded = inv[None, :, None].float().expand(position_ids.shape[0], -1, 1)  # [B, D/2, 1]
    freqs = (inv_expanded @ position_ids[:, None, :].float()).transpose(1, 2)  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)


def device_longrope_forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs):
    """The rotary's forward, installed on its instance by `install_device_longrope`."""
    return longrope_cos_sin(x, position_ids, self.device_rope_inv_freq, self.device_rope_scale, self.device_rope_switch)


def rope_switch(config) -> int | None:
    """The first position a longrope model (Phi-3.5-MoE) computes with its long factors, else None.

    HF's longrope picks the long regime for a forward reaching position `original_max_position_embeddings`,
    and its generate() drops the KV cache there and recomputes the whole sequence with it."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") == "longrope" and params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"])
    return None


def install_device_longrope(hf_model: nn.Module) -> str:
    """Every longrope rotary of `hf_model` picks its regime on the device from now on. Returns "" when
    installed (or when the model has no longrope), else why not (HF's forward stays)."""
    rotaries = [m for m in hf_model.modules() if getattr(m, "rope_type", None) == "longrope" and hasattr(m, "config")]
    for rotary in rotaries:
        switch = rope_switch(rotary.config)
        if switch is None:
            return f"{type(rotary).__name__} has no original_max_position_embeddings"
        regimes = probe_regimes(rotary, switch)
        if isinstance(regimes, str):
            return regimes
        short, long = regimes
        device = short.inv_freq.device
        rotary.register_buffer("device_rope_inv_freq", torch.stack([short.inv_freq, long.inv_freq]), persistent=False)
        rotary.register_buffer("device_rope_scale", torch.tensor([short.scale, long.scale], dtype=torch.float32,
                                                                  device=device), persistent=False)
        rotary.device_rope_switch = switch
        rotary.forward = types.MethodType(device_longrope_forward, rotary)
    return ""


def probe_regimes(rotary: nn.Module, switch: int) -> tuple[RopeRegime, RopeRegime] | str:
    """(short, long): for each regime the candidate frequencies and scale that give HF's forward exactly at
    positions on that side of the switch, or why none does."""
    device = _buffer_device(rotary)
    params = rotary.config.rope_parameters
    inv_short, attention = rotary.rope_init_fn(rotary.config)
    inv_long, _ = rotary.rope_init_fn(rotary.config, seq_len=switch + 1)
    inv_candidates = [inv_short.float().to(device), inv_long.float().to(device)]
    scales = [s for s in (params.get("short_mscale"), params.get("long_mscale"), attention) if s is not None]
    x = torch.zeros(1, 1, device=device)  # float32: the probe compares before any rounding to the model's dtype
    first = max(switch - SHORT_PROBE, 0)
    probes = {"short": torch.arange(first, switch, device=device)[None],  # max + 1 == switch: short
              "long": torch.arange(first, switch + SHORT_PROBE, device=device)[None]}  # past the switch: long
    found = []
    for name, positions in probes.items():
        expected = hf_rotary_output(rotary, x, positions)
        match = next((RopeRegime(inv, float(s)) for inv in inv_candidates for s in scales
                      if _same(expected, _regime_output(x, positions, inv, float(s)))), None)
        if match is None:
            return f"{type(rotary).__name__}'s {name} regime is not a (frequencies, scale) pair longrope defines"
        found.append(match)
    return found[0], found[1]


def hf_rotary_output(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own forward of `rotary` at `positions`, its buffers and attributes left as they were."""
    buffers, attributes = dict(rotary._buffers), dict(vars(rotary))
    try:
        with torch.no_grad():
            return type(rotary).forward(rotary, x, position_ids=positions)
    finally:
        for name in set(vars(rotary)) - set(attributes):
            delattr(rotary, name)
        rotary._buffers.clear()
        rotary._buffers.update(buffers)


def _regime_output(x, positions, inv_freq: torch.Tensor, scale: float):
    both = torch.stack([inv_freq, inv_freq])
    return longrope_cos_sin(x, positions, both, torch.tensor([scale, scale], device=x.device), 0)


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b))


def _buffer_device(rotary: nn.Module) -> torch.device:
    buffers = list(rotary.buffers())
    return buffers[0].device if buffers else torch.device("cpu")

"""Which of Specter's mechanisms run for one engine: each switches itself off where it cannot apply, and says why."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specter.config import SpecterConfig
from specter.offload.residual_store import residual_dtype_problem

MECHANISMS = ("prefetch", "expert_wise", "cuda_graph", "draft_compile", "draft_ahead", "residual_transfer",
              "pooled_slots", "coded_slots")
NOT_ASKED = "off: not asked"
RESIDENT = "off: every expert resident on the device (nothing is loaded)"


@dataclass(frozen=True)
class Resolved:
    """The config an engine runs (K resolved, what cannot apply turned off) and each mechanism's state:
    "on" or "off: <reason>"."""

    config: SpecterConfig
    mechanisms: dict[str, str]


def resolve(config: SpecterConfig, model) -> Resolved:
    """`config` as it can run on `model`: K from the model's depth profile where unset, and every mechanism
    that cannot apply here switched off with its reason."""
    slots = config.resident_experts_per_layer
    states = {
        "prefetch": offload_state(config.prefetch, slots),
        "expert_wise": NOT_ASKED if not config.expert_wise else "on",
        "cuda_graph": graph_state(config, model.device),
        "draft_compile": NOT_ASKED if not config.draft_compile else compile_state(config, model.device),
        "draft_ahead": NOT_ASKED if not config.draft_ahead else off_if(draft_ahead_problem(config, model)
                                                                       or side_stream_problem(model.device)),
        "residual_transfer": residual_state(config.residual_transfer, slots, model.dtype),
        "pooled_slots": pooled_state(config.pooled_slots, slots),
    }
    states["coded_slots"] = coded_state(config.coded_slots, slots, states["residual_transfer"])
    pooled = min(config.pooled_slots, slots - 1) if states["pooled_slots"] == "on" else 0  # a slot each layer keeps
    running = dataclasses.replace(
        config, k=config.k if config.k is not None else model.spec.k_for(slots),
        cuda_graph=states["cuda_graph"] == "on", draft_compile=states["draft_compile"] == "on",
        draft_ahead=states["draft_ahead"] == "on", residual_transfer=states["residual_transfer"] == "on",
        pooled_slots=pooled, coded_slots=states["coded_slots"] == "on")
    return Resolved(running, states)


def as_run(mechanisms: dict[str, str], graph_status: str) -> dict[str, str]:
    """`mechanisms` as they ran, given the draft step's capture (`DraftGraphCache.status`: "on", "on, compiled",
    "on, not compiled: why", "failed: why", "off" or "off: why"): the CUDA graph and its compilation stay "on"
    only where the step was captured (and compiled)."""
    ran = dict(mechanisms)
    captured = graph_status.startswith("on")
    if ran.get("cuda_graph") == "on" and not captured:
        reason = graph_status.removeprefix("failed: ").removeprefix("off: ")
        ran["cuda_graph"] = "off: " + (reason if reason != "off" else "no draft step captured")
    if ran.get("draft_compile") == "on" and graph_status != "on, compiled":
        ran["draft_compile"] = ("off: " + graph_status.removeprefix("on, ") if captured
                                else f"off: no CUDA graph to compile into ({ran['cuda_graph'].removeprefix('off: ')})")
    return ran


def off_if(problem: str) -> str:
    return f"off: {problem}" if problem else "on"


def draft_ahead_problem(config, model) -> str:
    """Why draft-ahead cannot run for this engine ("" when it can; it needs greedy decoding and a rotary that
    does not sync the host in every step)."""
    if not config.greedy:
        return "sampling (draft-ahead is greedy only)"
    if model.rope_on_host:
        return f"the rotary picks its regime on the host in every step ({model.rope_on_host})"
    return ""


def side_stream_problem(device: torch.device) -> str:
    """Why draft-ahead cannot gain on `device` ("" on CUDA): it drafts the next window on a side stream while the
    verify pass runs; without one it runs in series and only adds the draft's work."""
    return "" if device.type == "cuda" else "no CUDA device (nothing to run the draft beside the verify pass)"


def offload_state(asked: bool, slots: int | None) -> str:
    if not asked:
        return NOT_ASKED
    return RESIDENT if slots is None else "on"


def graph_state(config: SpecterConfig, device: torch.device) -> str:
    if not config.cuda_graph:
        return NOT_ASKED
    if device.type != "cuda":
        return "off: no CUDA device"
    return "off: sampling (graphs replay greedy draft steps)" if not config.greedy else "on"


def compile_state(config: SpecterConfig, device: torch.device) -> str:
    graph = graph_state(config, device)
    return "on" if graph == "on" else f"off: no CUDA graph to compile into ({graph.removeprefix('off: ')})"


def residual_state(asked: bool, slots: int | None, dtype: torch.dtype) -> str:
    if not asked:
        return NOT_ASKED
    if slots is None:
        return RESIDENT
    return off_if(residual_dtype_problem(dtype))


def pooled_state(pooled: int, slots: int | None) -> str:
    if pooled == 0:
        return NOT_ASKED
    if slots is None:
        return RESIDENT
    return "off: needs at least 2 slots per layer (each layer keeps one of its own)" if slots < 2 else "on"


def coded_state(asked: bool, slots: int | None, transfer: str) -> str:
    """Residual-coded slots hold the blobs that residual transfer moves."""
    if not asked:
        return NOT_ASKED
    if slots is None:
        return RESIDENT
    return "on" if transfer == "on" else f"off: needs residual transfer (residual_transfer {transfer})"

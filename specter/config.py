"""Frozen run-time configuration of the Specter engine (plain dataclasses, no Hydra)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specter.errors import SpecterError

EVICTION_POLICIES = ("lru", "lookahead", "popularity")
MAX_CACHE_LEN = 256  # positions of the static KV cache at least (grown when a request needs more; 16 + 128 fits)
PAPER_DESIGN = {"draft_compile": False, "draft_ahead": False, "residual_transfer": False, "pooled_slots": 0,
                "coded_slots": False}


@dataclass(frozen=True)
class SpecterConfig:
    """How one engine decodes. The defaults are the fastest lossless configuration measured; `paper()` is the
    paper's design. A mechanism that cannot apply switches itself off and says why (`result.stats["mechanisms"]`).
    Every field is checked here; a bad value is a one-line SpecterError. The harness's conf/specter/default.yaml
    repeats these defaults (checked by a test).

    k: speculation depth (draft tokens per iteration), >= 1; None: the model's depth-profiled K for this memory
      setting where it has one, else its default K (ModelSpec.k_for).
    resident_experts_per_layer: FP expert-cache slots per MoE layer (None = all experts resident).
    temperature: 0 means greedy; > 0 samples with standard speculative (rejection) sampling.
    top_p: nucleus filter applied to both draft and target distributions when sampling.
    seed: seed of the sampling generator.
    prefetch: the paper's draft-time lookahead prefetch of FP experts (ablation: off = on-demand loading only).
    expert_wise: the paper's expert-wise verification (ablation: off = token-wise, chronological GEMVs).
    eviction: expert-cache victim policy, "lru" (the paper's), "lookahead" (never evicts an expert the current
      draft window predicts while another slot will do) or "popularity" (evicts the expert the target has
      routed the fewest tokens to in this request, LRU among ties).
    cuda_graph: on CUDA with greedy decoding, replay the draft step as a CUDA graph over a static KV cache
      (ablation: off = eager draft).
    draft_compile: torch.compile the draft step before capturing it (fused kernels for the dense part of each
      layer; a failure falls back to the plain step and says why in draft_graph).
    draft_ahead: during each verify pass the draft drafts the next window on a side stream over a KV cache of
      its own, from its guess of the bonus token, and the first window from the prompt while the prefill runs;
      a window takes those drafts when the target accepted what they assumed (greedy single requests).
    residual_transfer: expert loads move the lossless residual of each 16-bit expert against the draft's INT4
      codes already on the GPU (about 0.55x of the bytes in bf16, 0.7x in fp16); a GPU kernel rebuilds the exact
      weights, and a decode group's blob copies are issued together.
    pooled_slots: N of each MoE layer's slots join the shared spare rows, lent to the layer being verified,
      which then verifies in waves of every slot it holds (fewer, wider waves in the same memory).
    coded_slots: with residual transfer, the slots' memory holds residual blobs instead of 16-bit experts (about
      2x as many experts in bf16, 1.45x in fp16, less 8 16-bit scratch rows); loads and prefetches copy blobs,
      and each verify wave (at most 8 experts) rebuilds its experts' exact weights into the scratch rows just
      before its GEMMs.
    """

    k: int | None = None
    resident_experts_per_layer: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    prefetch: bool = True
    expert_wise: bool = True
    eviction: str = "lru"
    cuda_graph: bool = True
    draft_compile: bool = True
    draft_ahead: bool = True
    residual_transfer: bool = True
    pooled_slots: int = 2
    coded_slots: bool = True

    def __post_init__(self) -> None:
        if self.k is not None:
            _integer(self, "k", 1, "speculation depth k", " or None")
        if self.resident_experts_per_layer is not None:
            _integer(self, "resident_experts_per_layer", 1, suffix=" or None")
        _number(self, "temperature", "a finite number >= 0", lambda x: x >= 0)
        _number(self, "top_p", "a number in (0, 1]", lambda x: 0.0 < x <= 1.0)
        _integer(self, "seed", None)
        for name in ("prefetch", "expert_wise", "cuda_graph", "draft_compile", "draft_ahead", "residual_transfer",
                     "coded_slots"):
            if not isinstance(getattr(self, name), bool):
                raise SpecterError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.eviction, str) or self.eviction not in EVICTION_POLICIES:
            raise SpecterError(f"eviction must be 'lru', 'lookahead' or 'popularity', got {self.eviction!r}")
        _integer(self, "pooled_slots", 0)

    @classmethod
    def paper(cls, **fields) -> SpecterConfig:
        """The paper's design: speculative decoding with INT4 draft experts, draft-time prefetch and expert-wise
        verification over raw FP16 copies, without this project's mechanisms (`fields` override any field)."""
        return cls(**{**PAPER_DESIGN, **fields})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_against(self, num_experts: int) -> None:
        """Raise if the residency asks for more slots than the model has experts per layer."""
        slots = self.resident_experts_per_layer
        if slots is not None and slots > num_experts:
            raise SpecterError(
                f"resident_experts_per_layer={slots} exceeds the model's {num_experts} routed experts per layer"
            )


def _integer(config: SpecterConfig, name: str, least: int | None, what: str | None = None, suffix: str = "") -> None:
    """Raise unless config.<name> is an int (not a bool) >= least (any int when least is None)."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        bound = "" if least is None else f" >= {least}"
        raise SpecterError(f"{what or name} must be an integer{bound}{suffix}, got {value!r}")


def _number(config: SpecterConfig, name: str, what: str, ok) -> None:
    """Raise unless config.<name> is a finite int or float (not a bool) for which ok() holds; store it as a float."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise SpecterError(f"{name} must be {what}, got {value!r}")
    object.__setattr__(config, name, float(value))  # 1 from a config file is 1.0

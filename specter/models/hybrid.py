"""The shared-instance hybrid-precision model: one HF model whose routed experts run in draft or target mode."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specter.models.device_rope import install_device_longrope
from specter.models.hybrid_experts import DRAFT, TARGET, HybridExperts, is_hf_experts
from specter.models.registry import ModelSpec

if TYPE_CHECKING:  # the offload runtime imports the models; these are annotations only
    from specter.offload.host_store import HostExpertStore
    from specter.offload.residual_store import ResidualExpertStore
    from specter.offload.runtime import OffloadRuntime


@dataclass
class HybridMoEModel:
    """Draft and target are this one object in two modes.

    Every non-expert tensor (embeddings, attention, norms, routers, shared experts, dense layers, lm_head)
    and the committed KV cache serve both modes; only the routed experts differ: INT4 for the draft,
    full precision for the target.
    """

    hf: nn.Module
    spec: ModelSpec
    tokenizer: Any
    experts: list[HybridExperts]
    quantizer: str = "rtn"
    host_store: HostExpertStore | None = None  # once the FP experts live in host memory
    residual_store: ResidualExpertStore | None = None  # where the build encoded the experts (raw never kept)
    offload: OffloadRuntime | None = None  # the expert cache and default residency manager serving them
    rope_on_host: str = ""  # why the rotary still picks its regime on the host ("": on the device, or no longrope)

    def __post_init__(self) -> None:
        """A longrope rotary picks its regime on the device (specter.models.device_rope), or says why not."""
        self.rope_on_host = install_device_longrope(self.hf)

    def observe_draft_routing(self, observer):
        """Report every draft-mode top-k routing to `observer(moe_layer, top_k_index)` inside the block
        (nested blocks restore the outer observer)."""
        return self._experts_bound("routing_observer", observer)

    def executing(self, executor):
        """The enclosed target forwards run each routed-experts layer through `executor(module, hidden, top_k_index,
        top_k_weights)`; each layer's own afterwards (its device experts, or the offload runtime's manager)."""
        return self._experts_bound("target_executor", executor)

    @contextmanager
    def _experts_bound(self, name: str, value) -> Iterator[None]:
        """Every routed-experts module's attribute `name` is `value` inside the block, what it was afterwards."""
        previous = [getattr(module, name) for module in self.experts]
        for module in self.experts:
            setattr(module, name, value)
        try:
            yield
        finally:
            for module, outer in zip(self.experts, previous):
                setattr(module, name, outer)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: the token ids a prompt may hold are 0 .. vocab_size - 1."""
        return self.hf.get_input_embeddings().weight.shape[0]

    @property
    def max_positions(self) -> int | None:
        """The context the model holds: a prompt's tokens plus the new ones (the config's max_position_embeddings)."""
        positions = getattr(self.hf.config, "max_position_embeddings", None)
        return int(positions) if positions else None

    @property
    def num_moe_layers(self) -> int:
        return len(self.experts)

    @property
    def num_experts(self) -> int:
        return self.experts[0].num_experts

    @property
    def top_k(self) -> int:
        return int(self.hf.config.num_experts_per_tok)

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    @contextmanager
    def mode(self, name: str) -> Iterator[None]:
        """Run the enclosed forwards with the routed experts in `name` mode ("draft" or "target")."""
        if name not in (DRAFT, TARGET):
            raise ValueError(f"mode must be {DRAFT!r} or {TARGET!r}, got {name!r}")
        previous = self.experts[0].mode
        self._set_mode(name)
        try:
            yield
        finally:
            self._set_mode(previous)

    def _set_mode(self, name: str) -> None:
        for module in self.experts:
            module.mode = name

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache, mode: str = TARGET, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, executor=None, draft_workspace=None) -> torch.Tensor:
        """Logits [B, T, V] of `input_ids` [B, T] appended to `cache` (which it extends).

        Batched decoding passes `attention_mask` [B, cached + T] (0 = a hole: padding or a rejected
        position) and each request's own `position_ids` [B, T]. `executor`: what runs a target forward's routed
        experts (a system's residency manager, or its window's `PlannedVerify`; None: each layer's own).
        `draft_workspace`: the draft kernels' buffers in a draft forward (an engine's MoEWorkspace, which its
        captured draft steps point into; None: each layer's own).
        """
        if mode == TARGET and executor is not None:
            with self.mode(mode), self.executing(executor):
                return self._logits(input_ids, cache, attention_mask, position_ids)
        if mode == DRAFT and draft_workspace is not None:
            with self.mode(mode), self._experts_bound("draft_workspace", draft_workspace):
                return self._logits(input_ids, cache, attention_mask, position_ids)
        with self.mode(mode):
            return self._logits(input_ids, cache, attention_mask, position_ids)

    def _logits(self, input_ids, cache, attention_mask, position_ids) -> torch.Tensor:
        return self.hf(input_ids=input_ids, past_key_values=cache, use_cache=True, attention_mask=attention_mask,
                       position_ids=position_ids).logits

    def shared_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors both modes read: everything except the routed experts."""
        return {n: p for n, p in self.hf.named_parameters() if not self._is_expert_tensor(n)}

    def mode_tensors(self, mode: str) -> dict[str, torch.Tensor]:
        """Every tensor a forward in `mode` reads: the shared ones plus that mode's routed experts."""
        tensors = dict(self.shared_tensors())
        for i, m in enumerate(self.experts):
            if mode == DRAFT:
                tensors.update({f"experts.{i}.draft.{n}": t for n, t in m.named_buffers() if n.startswith("draft")})
            elif self.offload is not None:
                tensors["experts.slot_pool"] = self.offload.cache.pool  # every layer's slots
            else:
                tensors.update({f"experts.{i}.gate_up_proj": m.gate_up_proj, f"experts.{i}.down_proj": m.down_proj})
        return tensors

    @staticmethod
    def _is_expert_tensor(name: str) -> bool:
        return ".experts." in f".{name}" and (name.endswith("gate_up_proj") or name.endswith("down_proj"))


def hf_experts_modules(hf_model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every transformers-5 routed-experts module, in layer order."""
    found = [(name, module) for name, module in hf_model.named_modules() if is_hf_experts(module)]
    if not found:
        raise ValueError(f"{type(hf_model).__name__} has no transformers-5 *Experts modules to replace")
    return found


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name), attr, new)


def hybridize(hf_model: nn.Module, spec: ModelSpec, tokenizer: Any, quantizer: str = "rtn") -> HybridMoEModel:
    """Swap every HF `*Experts` module of `hf_model` for a HybridExperts (in place) and wrap the result."""
    experts = []
    for moe_layer, (name, module) in enumerate(hf_experts_modules(hf_model)):
        hybrid = HybridExperts.from_hf(module, moe_layer)
        replace_module(hf_model, name, hybrid)
        experts.append(hybrid)
    hf_model.eval()
    return HybridMoEModel(hf_model, spec, tokenizer, experts, quantizer)

"""Transformers baseline: HF greedy generate() on an Accelerate device map under Specter's GPU memory budget."""
from __future__ import annotations

import importlib

import torch
from transformers.generation.streamers import BaseStreamer

from baselines.export import plain_hf_model
from specter.config import SpecterConfig
from specter.errors import SpecterError
from specter.inputs import check_batch, check_prompt, is_batch
from specter.metrics import DecodeMetrics, GenerationResult
from specter.models.hybrid import HybridMoEModel
from specter.device.budget import MemoryPlan, plan_memory

OFFLOADED = ("cpu", "disk")


class CommitStreamer(BaseStreamer):
    """generate() hands each new token to put() inside its loop: one commit on the decode timeline each.

    The first put() is the prompt, not a generated token.
    """

    def __init__(self, metrics: DecodeMetrics, per_request: bool = False) -> None:
        self.metrics, self.per_request, self.prompt_seen = metrics, per_request, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:  # [B] new tokens: one per request (a batch's requests share each step's time)
            self.metrics.commit(1 if self.per_request else value.shape[0])
        self.prompt_seen = True

    def end(self) -> None:
        pass


def weights_budget(plan: MemoryPlan, slots: int) -> int:
    """GPU bytes Accelerate may fill with weights: Specter's total for `slots` minus the KV and workspace
    reserve, which HF's own KV cache and activations need just as Specter's do."""
    return plan.bytes_for(slots) - plan.kv_bytes - plan.workspace_bytes


def decoder_layers(hf: torch.nn.Module) -> list[str]:
    """Qualified names of the decoder layers (the model's no-split modules), in order."""
    return [name for name, m in hf.named_modules() if type(m).__name__ in hf._no_split_modules]


def placement(device_map: dict, layers: list[str]) -> dict:
    """How many decoder layers run from GPU memory and how many are offloaded (brought in on demand)."""
    def devices(layer: str) -> set:
        return {str(d) for k, d in device_map.items()
                if k == "" or k == layer or layer.startswith(k + ".") or k.startswith(layer + ".")}
    offloaded = sum(1 for layer in layers if devices(layer) & set(OFFLOADED))
    return {"gpu_layers": len(layers) - offloaded, "cpu_layers": offloaded}


class Transformers:
    """The plain HF model with Specter's exact target weights (`baselines.export`), greedy `generate`.

    On CUDA the model is dispatched by Accelerate: `infer_auto_device_map` under the weights budget
    (the model's no-split modules kept whole), `dispatch_model` executing offloaded layers on the GPU
    with their weights copied in on demand. Without a GPU it runs on the CPU whole (device_map "cpu").
    Built at the first generate. Per-token times come from the streamer inside HF's decode loop.
    """

    name = "transformers"
    batch_mode = True  # HF's own batching: left padding and an attention mask

    def __init__(self, model: HybridMoEModel, resident_experts_per_layer: int | None = None) -> None:
        self.model = model
        plan = plan_memory(model.spec, model.hf.config, model.dtype)
        slots = resident_experts_per_layer or plan.num_experts
        self.budget, self.weights_budget = plan.bytes_for(slots), weights_budget(plan, slots)
        self.hf, self.device, self.layout = None, None, {}

    def available(self) -> tuple[bool, str]:
        try:
            importlib.import_module("accelerate")
        except ImportError as error:
            return False, f"accelerate cannot be imported ({error}); pip install accelerate"
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32) -> GenerationResult | list[GenerationResult]:
        """New tokens of a [1, T] prompt; of each request for a batch (HF's batched generate)."""
        if is_batch(input_ids):
            prompts = check_batch(input_ids, max_new_tokens, self.model.vocab_size, self.model.max_positions)
            return self._generate_batch(prompts, max_new_tokens)
        input_ids = check_prompt(input_ids, max_new_tokens, self.model.vocab_size, self.model.max_positions)
        hf, device = self._built()
        metrics = DecodeMetrics(device)
        out = hf.generate(input_ids.to(device), attention_mask=torch.ones_like(input_ids, device=device),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=getattr(hf.config, "pad_token_id", None), streamer=CommitStreamer(metrics))
        stats = metrics.summary()  # [1, T + N] above: the prompt, then N new tokens
        stats.update(self.layout, gpu_budget_bytes=self.budget, weights_budget_bytes=self.weights_budget)
        return GenerationResult(out[0, input_ids.shape[1]:].tolist(), stats)

    def _generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int) -> list[GenerationResult]:
        hf, device = self._built()
        pad = getattr(hf.config, "pad_token_id", None) or 0
        width = max(p.shape[1] for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, T], left-padded
        mask = torch.zeros_like(ids)
        for r, prompt in enumerate(prompts):
            ids[r, width - prompt.shape[1]:], mask[r, width - prompt.shape[1]:] = prompt[0], 1
        metrics = DecodeMetrics(device)
        out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=pad,
                          streamer=CommitStreamer(metrics, per_request=True))
        stats = metrics.summary()  # per request: every request gets one token per step
        stats.update(self.layout, gpu_budget_bytes=self.budget, weights_budget_bytes=self.weights_budget,
                     batch_size=len(prompts), mean_tpot_ms=stats["tpot_ms"],
                     throughput_tok_s=len(prompts) * stats["generated_tokens"] / stats["e2e_ms"] * 1e3)
        return [GenerationResult(out[r, width:].tolist(), dict(stats)) for r in range(len(prompts))]

    def _built(self) -> tuple[torch.nn.Module, torch.device]:
        if self.hf is None:
            ok, reason = self.available()
            if not ok:
                raise SpecterError(f"the Transformers baseline cannot run: {reason}")
            hf = plain_hf_model(self.model, "cpu")
            if self.model.device.type == "cuda":
                self.hf, self.device = self._dispatch(hf)
            else:
                self.hf, self.device = hf, torch.device("cpu")
                self.layout = {"device_map": "cpu", "gpu_layers": 0, "cpu_layers": len(decoder_layers(hf))}
        return self.hf, self.device

    def _dispatch(self, hf: torch.nn.Module) -> tuple[torch.nn.Module, torch.device]:
        """Accelerate's device map under the weights budget on the model's GPU; CPU layers run on the GPU."""
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.utils import get_max_memory

        gpu = self.model.device.index if self.model.device.index is not None else torch.cuda.current_device()
        max_memory = {gpu: self.weights_budget, "cpu": get_max_memory()["cpu"]}
        device_map = infer_auto_device_map(hf, max_memory=max_memory, dtype=self.model.dtype,
                                           no_split_module_classes=list(hf._no_split_modules))
        offloaded = any(str(d) in OFFLOADED for d in device_map.values())
        hf = dispatch_model(hf, device_map, main_device=torch.device("cuda", gpu), force_hooks=offloaded)
        self.layout = {"device_map": "accelerate", **placement(device_map, decoder_layers(hf)),
                       "device_map_entries": {k: str(d) for k, d in device_map.items()}}
        return hf, torch.device("cuda", gpu)


def make_transformers(model: HybridMoEModel, specter_config: SpecterConfig) -> Transformers:
    return Transformers(model, specter_config.resident_experts_per_layer)

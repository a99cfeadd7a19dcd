"""Target-only reference: plain autoregressive decoding of the full-precision target, one token per step."""
from __future__ import annotations

import torch

from specter.batch.engine import active_requests, batch_results, generated_tokens
from specter.batch.state import BatchState, refuse_rope_switch
from specter.inputs import check_batch, check_prompt, is_batch
from specter.kernels.moe_align import MoEWorkspace
from specter.metrics import DecodeMetrics, GenerationResult, h2d_split
from specter.models.hybrid import HybridMoEModel
from specter.offload.runtime import OffloadConfig, offload_session
from specter.speculative.state import StateManager
from specter.token_time import request_token_time


class TargetOnly:
    """Greedy decoding with the target experts only, on the same model object and KV state machinery.

    With `resident_experts_per_layer`, the experts come through the same expert cache and residency
    manager as Specter's, loaded on demand (the "target-only, same cache, no speculation" reference).
    """

    name = "target_only"
    batch_mode = True

    def __init__(self, model: HybridMoEModel, resident_experts_per_layer: int | None = None,
                 residual: bool = False) -> None:
        """`residual`: loads move residual blobs (the same exact weights; for a model whose host keeps only them)."""
        self.model = model
        self.slots = resident_experts_per_layer
        self.offload_config = None if self.slots is None else OffloadConfig(self.slots, residual=residual)
        self.verify_workspace = MoEWorkspace()
        if self.offload_config is not None:  # the experts move to the host store now
            self.offload_config.attach(model)

    def available(self) -> tuple[bool, str]:
        return True, ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, streams=None,
                 executor=None) -> GenerationResult | list[GenerationResult]:
        """New tokens of a [1, T] prompt; of each request for a batch (a list of prompts). `streams` (an
        offload.streams.DeviceStreams; default: the expert cache's, when offloaded) moves the experts: its bytes
        copied after the prefill give every result's `prefill_h2d_bytes`, its stalls the tpot_* columns.
        `executor` runs the routed experts of every forward (default: this system's residency manager when
        offloaded, else the model's own experts)."""
        batch = is_batch(input_ids)
        limits = (self.model.vocab_size, self.model.max_positions)
        prompts = check_batch(input_ids, max_new_tokens, *limits) if batch else None
        input_ids = None if batch else check_prompt(input_ids, max_new_tokens, *limits)
        session = self.session()
        if session is not None:
            streams, executor = streams or session.streams, executor or session.residency
        if batch:
            return self._generate_batch(prompts, max_new_tokens, session, streams, executor)
        return self._generate_one(input_ids, max_new_tokens, session, streams, executor)

    def session(self):
        """The call's offload session (its expert cache and residency manager), reset; None when resident."""
        if self.offload_config is None:
            return None
        session = offload_session(self.model, self.offload_config, self.verify_workspace)
        session.reset()
        return session

    def _generate_one(self, input_ids: torch.Tensor, max_new_tokens: int, session, streams,
                      executor) -> GenerationResult:
        """One token per step in one forward [1, 1] (at a longrope switch: the whole sequence)."""
        metrics = DecodeMetrics(self.model.device)
        state = StateManager(self.model, input_ids)
        next_token = state.prefill(executor).argmax(dim=-1, keepdim=True)  # [1], stays on the device
        prefill_bytes = streams.copied_bytes() if streams is not None else 0
        while True:
            state.commit(next_token.tolist(), kv_keep=len(state.tokens))  # the tokens committed before this one have KV
            metrics.commit(1)
            if len(state.generated) == max_new_tokens:
                break
            state.window(0)  # at a longrope switch: recompute the whole sequence
            metrics.begin("target")
            logits = self.model.forward(state.uncached(), state.cache, "target", executor=executor)[0, -1]
            next_token = logits.argmax(dim=-1, keepdim=True)
            metrics.end("target")
        stats = metrics.summary()
        stats.update(request_token_time(metrics, streams))
        if streams is not None:
            stats["prefill_h2d_bytes"] = prefill_bytes
        if session is not None:
            stats.update(session.stats())
        return GenerationResult(state.generated, h2d_split(stats, prefill_bytes, stats["generated_tokens"] - 1))

    def _generate_batch(self, prompts: list[torch.Tensor], max_new_tokens: int, session, streams,
                        executor) -> list[GenerationResult]:
        """All requests one token per step in one forward [B, 1]; each expert loaded once per step for all."""
        refuse_rope_switch(self.model, prompts, max_new_tokens)
        state = BatchState(self.model, prompts)
        metrics = [DecodeMetrics(self.model.device) for _ in prompts]
        state.commit_first(state.prefill(executor).argmax(dim=-1).tolist())
        prefill_bytes = streams.copied_bytes() if streams is not None else 0
        active = active_requests(state, max_new_tokens, None)
        for m in metrics:
            m.commit(1)
        while any(active):
            mask, positions = state.step_inputs(offset=0, length=1)
            logits = self.model.forward(state.last, state.cache, "target", mask, positions, executor)  # [B, 1, V]
            state.commit([[t] for t in logits[:, -1].argmax(dim=-1).tolist()], [0] * state.batch_size)
            for m, was_active in zip(metrics, active):
                if was_active:
                    m.commit(1)
            active = active_requests(state, max_new_tokens, None)
        shared = session.stats() if session is not None else {}
        if streams is not None:
            shared["prefill_h2d_bytes"] = prefill_bytes
        return batch_results(generated_tokens(state), metrics, max_new_tokens, None, shared)

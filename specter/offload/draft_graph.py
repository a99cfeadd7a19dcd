"""The greedy draft step (one token through every layer, INT4 experts, lookahead counters) as a replayed CUDA graph."""
from __future__ import annotations

import torch

from specter.models.hybrid_experts import DRAFT

WARMUP_STEPS = 2


class DraftStepGraph:
    """Captures `token -> argmax(draft logits)` once and replays it for every draft step.

    Needs fixed addresses and shapes: the static KV cache (its device-side length positions each
    step), a static input token, the lookahead counters and the draft kernel's workspace. Capture
    happens on a side stream after warm-up steps, whose KV writes and counts are rolled back.
    """

    def __init__(self, model, cache, elb, kv_length: int) -> None:
        self.model, self.cache, self.elb = model, cache, elb
        self.token = torch.zeros(1, 1, dtype=torch.long, device=model.device)  # static input
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), model.observe_draft_routing(elb.observe):
            for _ in range(WARMUP_STEPS):
                self._step()
                self._rollback(kv_length)
            with torch.cuda.graph(self.graph, stream=stream):
                self.next_token = self._step()  # [1, 1], static output
        torch.cuda.current_stream().wait_stream(stream)
        self._rollback(kv_length)

    def _step(self) -> torch.Tensor:
        logits = self.model.forward(self.token, self.cache, DRAFT)[0, -1]  # [V]
        return logits.argmax(dim=-1).view(1, 1)

    def _rollback(self, kv_length: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(kv_length)
        self.elb.clear()

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Replay one draft step for `token` [1, 1] (device); returns the draft's next token [1] (a copy)."""
        self.token.copy_(token.view(1, 1))
        self.graph.replay()
        return self.next_token.view(1).clone()


def capture_draft_step(model, cache, elb, kv_length: int) -> tuple[DraftStepGraph | None, str]:
    """(graph, "") or (None, reason) when capture is not possible here; the caller then drafts eagerly."""
    if model.device.type != "cuda":
        return None, "no CUDA device"
    try:
        return DraftStepGraph(model, cache, elb, kv_length), ""
    except Exception as err:  # capture rejects host syncs and unsupported ops: fall back, say why
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"

"""GPTQ INT4 quantization (Frantar et al. 2022) of the routed experts: the draft's calibrated quantizer.

It writes the packed layout of int4.py (symmetric, group 128: qweight [..., in/8, out] int32, scales
[..., in/g, out]), the same format as round-to-nearest, so `set_draft_weights` installs either.
`gptq_quantize` quantizes a stack of linears in one batched column loop; `quantize_experts_gptq` gathers
per-expert Hessians from calibration prompts through forward hooks, a pass of layers at a time, and keeps
RTN for experts that no calibration token reached. The algorithm and the memory plan are described in
docs/design.md, "INT4 draft".
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specter.errors import SpecterError
from specter.kernels.reference import expert_wise_moe, group_by_expert
from specter.quant.int4 import GROUP_SIZE, MAXQ, ZERO_POINT, Int4Linear, _check_shape, pack_codes, quantize_rtn

PERCDAMP = 0.01
BLOCKSIZE = 128
HESSIAN_BUDGET_BYTES = 4 << 30  # float32 Hessians held at once (per pass) when layers_per_pass is not given


class HessianAccumulator:
    """Running H = 2 X^T X / n over calibration inputs x [n, in] added in any number of batches (float32)."""

    def __init__(self, columns: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        self.columns = columns
        self.hessian = torch.zeros(columns, columns, device=device, dtype=dtype)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Add calibration inputs x [..., in] (flattened to rows)."""
        x = x.reshape(-1, x.shape[-1])
        if x.shape[-1] != self.columns:
            raise ValueError(f"input has {x.shape[-1]} columns, the accumulator {self.columns}")
        n = x.shape[0]
        if n == 0:
            return
        total = self.count + n
        x = x.to(device=self.hessian.device, dtype=self.hessian.dtype)
        self.hessian.mul_(self.count / total)
        self.hessian.addmm_(x.t(), x, alpha=2.0 / total)
        self.count = total

    def finalize(self) -> torch.Tensor:
        """H = 2 X^T X / n over everything added [in, in]."""
        if self.count == 0:
            raise ValueError("no calibration inputs were added")
        return self.hessian


def _upper_cholesky_of_inverse(hessian: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1 for H [B, n, n].

    damp = percdamp * mean(diag(H)) per matrix; a matrix whose factorisation fails gets 10x more (at most
    4 times), the others keep theirs, so a batch gives the same result as one matrix at a time.
    """
    n = hessian.shape[-1]
    eye = torch.eye(n, device=hessian.device, dtype=hessian.dtype)
    damp = percdamp * hessian.diagonal(dim1=-2, dim2=-1).mean(-1)  # [B]
    for _ in range(5):
        lower, info = torch.linalg.cholesky_ex(hessian + damp[:, None, None] * eye)
        failed = info != 0
        if not bool(failed.any()):
            inverse = torch.cholesky_inverse(lower)
            del lower
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            del inverse
            failed = (info != 0) | ~torch.isfinite(upper).flatten(1).all(dim=1)
            if not bool(failed.any()):
                return upper
            del upper
        else:
            del lower
        damp = torch.where(failed, damp * 10, damp)
    raise SpecterError("GPTQ: the calibration Hessian is not positive definite even with 10^4 x dampening "
                       "(non-finite activations?)")


def upper_inverse_factors(hessians: list[torch.Tensor], percdamp: float = PERCDAMP
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hinv [B, in, in]: upper Cholesky factors of (H + damp I)^-1, dead [B, in]: zero-diagonal columns) of
    B Hessians [in, in], one matrix at a time. Consumes the list: each entry is released once factored, so
    a batch holds a single Hessian's temporaries beside the factors."""
    first = hessians[0]
    n = first.shape[-1]
    Hinv = torch.empty(len(hessians), n, n, dtype=torch.float32, device=first.device)
    dead = torch.empty(len(hessians), n, dtype=torch.bool, device=first.device)
    del first
    for b in range(len(hessians)):
        H = hessians[b].detach().to(torch.float32).clone()  # [in, in]
        hessians[b] = None
        dead[b] = H.diagonal() == 0
        H.diagonal().masked_fill_(dead[b], 1.0)
        Hinv[b] = _upper_cholesky_of_inverse(H[None], percdamp)[0]
        del H
    return Hinv, dead


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor | list[torch.Tensor], group_size: int = GROUP_SIZE,
                  blocksize: int = BLOCKSIZE, percdamp: float = PERCDAMP) -> Int4Linear:
    """GPTQ (symmetric INT4, group-wise, desc_act=False) of W [..., out, in] given H [..., in, in].

    Leading dims are a batch (e.g. experts), each with its own Hessian; `hessian` may also be a list of
    [in, in], one per linear of the flattened batch, which is consumed (see `upper_inverse_factors`).
    Returns the packed layout of int4.py: qweight [..., in/8, out] int32, scales [..., in/g, out] in W's dtype.
    """
    _check_shape(weight, group_size)
    out_features, in_features = weight.shape[-2:]
    batch_shape = weight.shape[:-2]
    if isinstance(hessian, torch.Tensor):
        if hessian.shape[-2:] != (in_features, in_features) or hessian.shape[:-2] != batch_shape:
            raise ValueError(f"Hessian {tuple(hessian.shape)} does not fit weight {tuple(weight.shape)}")
        hessian = list(hessian.reshape(-1, in_features, in_features).unbind(0))
    elif len(hessian) != batch_shape.numel() or any(h.shape != (in_features, in_features) for h in hessian):
        raise ValueError(f"{len(hessian)} Hessians do not fit weight {tuple(weight.shape)}")
    store_dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    # computed where the Hessian is (the activations' device), even if the target weights live elsewhere
    Hinv, dead = upper_inverse_factors(hessian, percdamp)  # [B, in, in] upper, [B, in]
    W = weight.detach().reshape(-1, out_features, in_features).to(device=Hinv.device, dtype=torch.float32).clone()
    W.masked_fill_(dead[:, None, :], 0.0)

    B = W.shape[0]
    codes = torch.empty(B, out_features, in_features, dtype=torch.uint8, device=W.device)
    scales = torch.empty(B, out_features, in_features // group_size, dtype=store_dtype, device=W.device)
    scale = None  # [B, out] float32, the current group's (storage-rounded) scale
    tiny = torch.finfo(store_dtype).tiny  # smallest normal of the storage dtype: a scale that survives rounding
    for i1 in range(0, in_features, blocksize):
        i2 = min(i1 + blocksize, in_features)
        W1 = W[:, :, i1:i2].clone()  # [B, out, b]
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                # The group's current weights: this block's updated columns, then (if the group runs past
                # the block) the later columns, which already carry all earlier blocks' updates.
                group = torch.cat([W1[:, :, i:], W[:, :, i2:]], dim=-1)[:, :, :group_size]
                stored = (2 * group.abs().amax(dim=-1) / MAXQ).clamp_min(tiny).to(store_dtype)  # never 0
                scales[:, :, col // group_size] = stored
                scale = stored.to(torch.float32)
            w = W1[:, :, i]  # [B, out]
            q = torch.clamp(torch.round(w / scale) + ZERO_POINT, 0, MAXQ)
            codes[:, :, col] = q.to(torch.uint8)
            d = Hinv1[:, i, i]  # [B]
            err = (w - (q - ZERO_POINT) * scale) / d[:, None]  # [B, out]
            W1[:, :, i:] -= err[:, :, None] * Hinv1[:, None, i, i:]
            Err1[:, :, i] = err
        if i2 < in_features:
            W[:, :, i2:] -= torch.bmm(Err1, Hinv[:, i1:i2, i2:])

    qweight = pack_codes(codes).reshape(*batch_shape, in_features // 8, out_features)
    scales = scales.transpose(-1, -2).reshape(*batch_shape, in_features // group_size, out_features).contiguous()
    return Int4Linear(qweight, scales, group_size)


class _StopForward(Exception):
    """Raised by the hook of a pass's last layer: the rest of the forward is not needed."""


def target_layer_weights(model, module) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP target weights (gate_up [E, 2I, H], down [E, H, I]) of one HybridExperts layer, wherever they
    live: on the module (the HF parameters) or, once offloaded, in the model's host store (views)."""
    gate_up = getattr(module, "gate_up_proj", None)
    if gate_up is not None:
        return gate_up.detach(), module.down_proj.detach()
    store = getattr(model, "host_store", None)
    if store is None:
        raise SpecterError(f"MoE layer {module.moe_layer} has no target expert weights (neither on the module "
                           "nor in a host store)")
    return store.layer_weights(module.moe_layer)


def _streaming_executor(model):
    """A plain target executor for calibration when the FP experts are only in the host store and no
    offload runtime is attached: each routed expert is copied to the compute device when it is needed."""
    def executor(module, hidden, top_k_index, top_k_weights):
        gate_up, down = target_layer_weights(model, module)
        return expert_wise_moe(hidden, top_k_index, top_k_weights,
                               lambda e: (gate_up[e].to(hidden.device), down[e].to(hidden.device)),
                               module.num_experts, module.act_fn)
    return executor


class _LayerHessians:
    """Per-expert Hessians of one HybridExperts layer, filled by a forward hook (allocated per routed expert)."""

    def __init__(self, module, gate_up: torch.Tensor, stop_after: bool):
        self.module = module
        self.gate_up_weight = gate_up  # [E, 2I, H], FP target weights (possibly on the host)
        self.stop_after = stop_after
        self.gate_up: dict[int, HessianAccumulator] = {}
        self.down: dict[int, HessianAccumulator] = {}
        self.rows = 0

    def hook(self, module, args, kwargs, output):
        hidden, top_k_index = _expert_inputs(args, kwargs)
        self.add(hidden, top_k_index)
        if self.stop_after:
            raise _StopForward

    @torch.no_grad()
    def add(self, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        m = self.module
        h, i = m.hidden_dim, m.intermediate_dim
        x = hidden.reshape(-1, h)
        groups = group_by_expert(top_k_index.reshape(x.shape[0], -1), m.num_experts)
        for e, tok in zip(groups.experts, groups.token_idx):
            xe = x[tok]  # [n_e, H]: the hidden rows routed to expert e
            gate, up = F.linear(xe, self.gate_up_weight[e].to(xe.device)).chunk(2, dim=-1)  # FP expert weights
            if e not in self.gate_up:
                self.gate_up[e] = HessianAccumulator(h, device=x.device)
                self.down[e] = HessianAccumulator(i, device=x.device)
            self.gate_up[e].add(xe)
            self.down[e].add(m.act_fn(gate) * up)  # the down projection's input
            self.rows += xe.shape[0]


def _expert_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, top_k_index) of a HybridExperts call, positional or by keyword."""
    values = list(args)
    for name in ("hidden_states", "hidden", "top_k_index"):
        if len(values) < 2 and name in kwargs:
            values.append(kwargs[name])
    return values[0], values[1]


def layer_hessian_bytes(module) -> int:
    """Float32 bytes of one layer's Hessians if every expert is routed: E * (H^2 + I^2) * 4."""
    return module.num_experts * (module.hidden_dim ** 2 + module.intermediate_dim ** 2) * 4


def experts_per_batch(in_features: int, out_features: int, budget: int, routed: int) -> int:
    """Experts `gptq_quantize` takes at once within `budget` bytes, in batches of even size: each expert
    holds its float32 factor [in, in] and its weights [out, in] in float32 (twice while they are converted),
    beside one Hessian's temporaries (four [in, in]: the copy, the damped matrix, its Cholesky factor, the
    inverse)."""
    per_expert = (in_features * in_features + 2 * out_features * in_features) * 4
    fits = max(1, (budget - 16 * in_features * in_features) // per_expert)
    batches = -(-routed // fits)
    return max(1, -(-routed // batches))


def batch_budget(device: torch.device, fallback: int) -> int:
    """Bytes a GPTQ batch may take on `device`: 90% of what CUDA has free (reserved-but-unused included),
    `fallback` elsewhere."""
    if device.type != "cuda":
        return fallback
    free, _ = torch.cuda.mem_get_info(device)
    return int(0.9 * (free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)))


@torch.no_grad()
def _quantize_layer(module, weights: tuple[torch.Tensor, torch.Tensor], hessians: _LayerHessians, group_size: int,
                    blocksize: int, percdamp: float, expert_batch: int | None, budget: int) -> int:
    """GPTQ for the routed experts of one layer, RTN for the rest; installs them; returns #GPTQ experts.
    Routed experts go through `gptq_quantize` `expert_batch` at a time (None: as many as fit the device's free
    memory on CUDA, `budget` bytes elsewhere)."""
    routed = sorted(hessians.gate_up)
    unrouted = [e for e in range(module.num_experts) if e not in hessians.gate_up]
    draft_device = module.draft_gate_up_qweight.device
    packed = []
    for weight, accs in zip(weights, (hessians.gate_up, hessians.down)):
        e, out_features, in_features = weight.shape
        _check_shape(weight, group_size)
        qweight = torch.empty(e, in_features // 8, out_features, dtype=torch.int32, device=draft_device)
        scales = torch.empty(e, in_features // group_size, out_features, dtype=weight.dtype, device=draft_device)
        if unrouted:  # never routed during calibration: round to nearest
            rtn = quantize_rtn(weight[unrouted], group_size)
            qweight[unrouted], scales[unrouted] = rtn.qweight.to(draft_device), rtn.scales.to(draft_device)
        start, device = 0, accs[routed[0]].hessian.device if routed else None  # where the Hessians are
        while start < len(routed):
            step = expert_batch or experts_per_batch(in_features, out_features, batch_budget(device, budget),
                                                     len(routed) - start)
            chunk = routed[start:start + step]
            start += step
            hess = [accs.pop(x).finalize() for x in chunk]  # gptq_quantize releases each once factored
            q = gptq_quantize(weight[chunk], hess, group_size, blocksize, percdamp)
            qweight[chunk], scales[chunk] = q.qweight.to(draft_device), q.scales.to(draft_device)
            del hess, q
        packed.append(Int4Linear(qweight, scales, group_size))
    module.set_draft_weights(*packed)
    return len(routed)


def _layer_passes(experts: Sequence, layers_per_pass: int | None, budget: int) -> list[list[int]]:
    if layers_per_pass is None:
        per_layer = max(layer_hessian_bytes(m) for m in experts)
        layers_per_pass = max(1, budget // per_layer)
    if layers_per_pass < 1:
        raise SpecterError(f"layers_per_pass must be at least 1, got {layers_per_pass}")
    layers = list(range(len(experts)))
    return [layers[i:i + layers_per_pass] for i in range(0, len(layers), layers_per_pass)]


def quantize_experts_gptq(
    model,
    calibration_ids: list[torch.Tensor],
    group_size: int = GROUP_SIZE,
    blocksize: int = BLOCKSIZE,
    percdamp: float = PERCDAMP,
    layers_per_pass: int | None = None,
    hessian_budget_bytes: int = HESSIAN_BUDGET_BYTES,
    expert_batch: int | None = None,
    progress: bool = False,
) -> dict:
    """GPTQ-quantize every routed expert of `model` (a HybridMoEModel) from calibration prompts [1, T].

    Installs the INT4 draft weights with `set_draft_weights`, sets `model.quantizer = "gptq"` and returns
    a report: per-layer counts of GPTQ and RTN-fallback (never routed) experts, calibration tokens, passes.
    docs/design.md ("INT4 draft") gives the algorithm and the layer-by-layer memory plan.
    """
    import transformers
    from tqdm import tqdm

    if not calibration_ids:
        raise SpecterError("GPTQ needs at least one calibration prompt")
    ids_list = [torch.as_tensor(ids).reshape(1, -1) for ids in calibration_ids]
    if any(ids.shape[-1] == 0 for ids in ids_list):
        raise SpecterError("a calibration prompt is empty")
    experts = model.experts
    passes = _layer_passes(experts, layers_per_pass, hessian_budget_bytes)
    weights = [target_layer_weights(model, m) for m in experts]
    # FP experts only in the host store and no offload runtime serving them: stream them for calibration
    streamed = [m for m in experts if m.target_executor is None and getattr(m, "gate_up_proj", None) is None]
    for m in streamed:
        m.target_executor = _streaming_executor(model)
    started = time.perf_counter()
    layers: list[dict] = [{} for _ in experts]
    try:
        with tqdm(total=len(experts), desc="gptq", unit="layer", file=sys.stderr, disable=not progress) as bar:
            for chunk in passes:
                hessians = {l: _LayerHessians(experts[l], weights[l][0], stop_after=(l == chunk[-1])) for l in chunk}
                handles = [experts[l].register_forward_hook(hessians[l].hook, with_kwargs=True) for l in chunk]
                bar.set_postfix_str(f"calibrating layers {chunk[0]}-{chunk[-1]}")
                try:
                    for ids in ids_list:
                        cache = transformers.DynamicCache(config=model.hf.config)
                        try:
                            model.forward(ids.to(model.device), cache, mode="target")
                        except _StopForward:
                            pass
                finally:
                    for handle in handles:
                        handle.remove()
                bar.set_postfix_str("quantizing")
                for l in chunk:
                    module = experts[l]
                    n_gptq = _quantize_layer(module, weights[l], hessians.pop(l), group_size, blocksize, percdamp,
                                             expert_batch, hessian_budget_bytes)
                    layers[l] = {"layer": l, "gptq_experts": n_gptq,
                                 "rtn_fallback_experts": module.num_experts - n_gptq}
                    bar.update(1)
    finally:
        for m in streamed:
            m.target_executor = None
    model.quantizer = "gptq"
    return {
        "quantizer": "gptq",
        "group_size": group_size,
        "percdamp": percdamp,
        "blocksize": blocksize,
        "num_prompts": len(ids_list),
        "calibration_tokens": int(sum(ids.shape[-1] for ids in ids_list)),
        "passes": len(passes),
        "layers": layers,
        "gptq_experts": sum(r["gptq_experts"] for r in layers),
        "rtn_fallback_experts": sum(r["rtn_fallback_experts"] for r in layers),
        "seconds": round(time.perf_counter() - started, 3),
    }


def quantize_experts_rtn(model, group_size: int = GROUP_SIZE, progress: bool = False) -> dict:
    """Round-to-nearest INT4 for every routed expert (the load-time default), with a report like GPTQ's."""
    from tqdm import tqdm

    started = time.perf_counter()
    layers = []
    for l, module in enumerate(tqdm(model.experts, desc="rtn", unit="layer", file=sys.stderr, disable=not progress)):
        gate_up, down = target_layer_weights(model, module)
        module.set_draft_weights(quantize_rtn(gate_up, group_size), quantize_rtn(down, group_size))
        layers.append({"layer": l, "rtn_experts": module.num_experts})
    model.quantizer = "rtn"
    return {"quantizer": "rtn", "group_size": group_size, "num_prompts": 0, "calibration_tokens": 0, "passes": 0,
            "layers": layers, "rtn_experts": sum(r["rtn_experts"] for r in layers),
            "seconds": round(time.perf_counter() - started, 3)}


__all__ = ["HessianAccumulator", "gptq_quantize", "layer_hessian_bytes", "quantize_experts_gptq",
           "quantize_experts_rtn", "target_layer_weights"]

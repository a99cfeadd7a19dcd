"""Residual store: every offloaded expert as a residual blob against the draft's INT4 codes, in (pinned) host memory.

Built once from the host store's 16-bit experts and the draft weights already on the device
(`specter.quant.residual_expert`); a cache load then moves the blob instead of the raw expert, and
`decode` rebuilds the exact weights into the slot from the blob and the draft's codes.
"""
from __future__ import annotations

from itertools import pairwise

import torch

from specter.errors import SpecterError
from specter.kernels.residual_decode import TRITON_AVAILABLE, DecodeLauncher, DecodePlan, expert_operands
from specter.offload.pinned import pin
from specter.offload.host_store import HostExpertStore
from specter.quant.int4 import Int4Linear, select_expert
from specter.quant.residual_expert import BlobLayout, decode_expert_reference, encode_experts, expert_layout

# The encode's temporaries peak at 96 bytes per weight of the linear it encodes (live tensor bytes, measured on
# the CPU with a dispatch-mode tracker, tests/test_residual_build.py); the build keeps them within ENCODE_WORK_BYTES
# whatever the expert size: several experts per encode where they are small, slices of one expert's rows where
# one linear alone is larger (phi, mixtral).
ENCODE_BYTES_PER_WEIGHT = 96
ENCODE_WORK_BYTES = 4 * 2**30


def encode_chunk(num_experts: int, hidden: int, intermediate: int, work_bytes: int) -> tuple[int, int]:
    """(experts per encode, weights per encode) so that an encode's temporaries stay within `work_bytes`."""
    max_weights = max(1, work_bytes // ENCODE_BYTES_PER_WEIGHT)
    largest = 2 * intermediate * hidden  # gate_up, the larger linear
    return max(1, min(num_experts, max_weights // largest)), max_weights


def kernel_check_picks(num_layers: int, num_experts: int) -> tuple[tuple[int, int], ...]:
    """The (layer, expert) pairs `check_kernel` rebuilds: the first layer's first and the last layer's last."""
    return (0, 0), (num_layers - 1, num_experts - 1)


def kernel_check_experts(store: HostExpertStore) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, expert) -> its raw flat weights, for the experts `check_kernel` rebuilds, copied now (the store may
    release its layers while the build runs)."""
    return {key: store.expert(*key).clone() for key in kernel_check_picks(store.num_layers, store.num_experts)}


def residual_dtype_problem(dtype: torch.dtype) -> str:
    """Why experts of `dtype` cannot move as residuals ("" if they can)."""
    if dtype in (torch.float16, torch.bfloat16):
        return ""
    return f"residual_transfer needs 16-bit experts (float16 or bfloat16); this model's are {str(dtype)[6:]}"


class ResidualExpertStore:
    """Per MoE layer one flat int32 host buffer of its experts' blobs (expert e at `offsets[layer][e]`).

    `drafts[layer]` is the layer's (gate_up, down) INT4 draft (stacked over experts, on the device), the
    codes every blob is encoded against; the draft model keeps them resident, so nothing of them moves.
    """

    def __init__(self, layout: BlobLayout, dtype: torch.dtype, drafts: list[tuple[Int4Linear, Int4Linear]],
                 buffers: list[torch.Tensor], offsets: list[list[int]]) -> None:
        self.layout, self.dtype, self.drafts = layout, dtype, drafts
        self.buffers, self.offsets = buffers, offsets
        self.blobs = [[buffer[a:b] for a, b in pairwise(row)] for buffer, row in zip(buffers, offsets)]  # views
        self.max_blob_words = max(blob.numel() for row in self.blobs for blob in row)  # staging capacity
        self.use_kernel = TRITON_AVAILABLE and drafts[0][0].qweight.is_cuda
        # Each load's launch arguments, prepared once per expert: its drafts' views.
        self.operands = [[expert_operands(self.expert_drafts(layer, e), dtype) for e in range(len(offsets[layer]) - 1)]
                         for layer in range(len(drafts))] if self.use_kernel else None
        self.layer_operands = [expert_operands(list(d), dtype) for d in drafts] if self.use_kernel else None

    @classmethod
    def build(cls, store: HostExpertStore, experts: list, release_raw: bool = False) -> ResidualExpertStore:
        """Encode every expert of `store` against its layer's draft (`experts`: the model's HybridExperts, in
        order), on the drafts' device (`ResidualLayers`). With `release_raw` each layer's raw experts leave the
        store once encoded (host memory peaks at the raw experts plus a layer's blobs, then holds the blobs only)."""
        layers = ResidualLayers(store.num_layers, store.num_experts, store.hidden, store.intermediate, store.dtype)
        for layer, module in enumerate(experts):
            gate_up, down = store.layer_weights(layer)  # [E, 2I, H], [E, H, I]
            layers.add(gate_up, down, (module.draft_gate_up, module.draft_down))
            del gate_up, down
            if release_raw:
                store.release_layer(layer)
        return layers.finish()

    def check_kernel(self, expected: dict[tuple[int, int], torch.Tensor]) -> None:
        """Raise SpecterError unless the Triton decode rebuilds each (layer, expert) of `expected` (its raw flat
        weights) bit for bit (no-op where the torch reference decodes): a GPU on which the kernel miscompiles
        stops here, not after serving wrong weights."""
        if not self.use_kernel:
            return
        launcher = self.launcher()
        for (layer, expert), raw in expected.items():
            device = self.drafts[layer][0].qweight.device
            out = torch.empty(raw.numel(), dtype=self.dtype, device=device)
            self.decode(layer, expert, launcher, self.blob(layer, expert).to(device), out)
            if not torch.equal(out.view(torch.int16).cpu(), raw.view(torch.int16).cpu()):
                raise SpecterError(f"the residual decode kernel does not rebuild layer {layer}'s expert {expert} bit "
                                   f"for bit on this GPU; run with residual_transfer=false and report it")

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """The expert's blob [n] int32 (a view into the layer's host buffer)."""
        return self.blobs[layer][expert]

    @property
    def total_bytes(self) -> int:
        return sum(buffer.numel() * 4 for buffer in self.buffers)

    @property
    def mean_blob_bytes(self) -> float:
        """Bytes one residual load moves, on average over the store's experts."""
        return self.total_bytes / sum(len(offsets) - 1 for offsets in self.offsets)

    def bits_per_weight(self) -> float:
        weights = sum(o * i for o, i in self.layout.shapes)
        return 8 * self.mean_blob_bytes / weights

    def expert_drafts(self, layer: int, expert: int) -> list[Int4Linear]:
        return [select_expert(draft, expert) for draft in self.drafts[layer]]

    def launcher(self) -> DecodeLauncher | None:
        """The decode launches of this store's experts; None without the kernel."""
        return DecodeLauncher(DecodePlan.of(self.layout, self.dtype)) if self.use_kernel else None

    def decode(self, layer: int, expert: int, launcher: DecodeLauncher | None, blob: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
        """The expert's exact weights into `out` (a flat 16-bit slot row) from its blob on the compute device:
        the Triton kernel on CUDA (through `launcher`), the torch reference elsewhere."""
        if launcher is not None:
            return launcher(self.operands[layer][expert], blob, out)
        return out.copy_(decode_expert_reference(blob, self.layout, self.expert_drafts(layer, expert), self.dtype))

    def decode_group(self, layer: int, launcher: DecodeLauncher, staging: torch.Tensor, pool: torch.Tensor,
                     items: torch.Tensor) -> None:
        """Several of the layer's experts in one launch (`specter.kernels.residual_decode.decode_experts`:
        items [n, 4] on the device, blobs in `staging`, outputs in `pool`)."""
        launcher.group(self.layer_operands[layer], staging, pool, items)


class ResidualLayers:
    """A residual store built one MoE layer at a time, in order, from each layer's experts as they come: a host
    store's layers, or a build's layers on the device before they would reach the host (then the raw experts are
    never all held at once). Each encode's temporaries stay within ENCODE_WORK_BYTES whatever the expert size:
    several experts per encode where they are small, slices of one expert's rows where one linear alone is
    larger (phi, mixtral); blobs pinned when the drafts are on a GPU."""

    def __init__(self, num_layers: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        if residual_dtype_problem(dtype):
            raise SpecterError(residual_dtype_problem(dtype))
        self.num_layers, self.num_experts, self.hidden, self.intermediate = num_layers, num_experts, hidden, intermediate
        self.dtype, self.layout = dtype, None  # the layout follows the drafts' quantization group (first `add`)
        self.experts_per_encode, self.max_weights = encode_chunk(num_experts, hidden, intermediate, ENCODE_WORK_BYTES)
        self.drafts: list[tuple[Int4Linear, Int4Linear]] = []
        self.buffers: list[torch.Tensor] = []
        self.offsets: list[list[int]] = []
        self.checked: dict[tuple[int, int], torch.Tensor] = {}  # raw experts the kernel must rebuild, on the CPU

    def add(self, gate_up: torch.Tensor, down: torch.Tensor, drafts: tuple[Int4Linear, Int4Linear]) -> None:
        """The next layer: its experts gate_up [E, 2I, H] and down [E, H, I] (any device) and its INT4 drafts."""
        layer, device = len(self.buffers), drafts[0].qweight.device
        self.layout = self.layout or expert_layout(self.hidden, self.intermediate, drafts[0].group_size)
        if TRITON_AVAILABLE and device.type == "cuda":
            for picked, expert in kernel_check_picks(self.num_layers, self.num_experts):
                if picked == layer:
                    self.checked[(layer, expert)] = torch.cat([gate_up[expert].reshape(-1),
                                                               down[expert].reshape(-1)]).cpu()  # [3*I*H]
        blobs = []
        for first in range(0, self.num_experts, self.experts_per_encode):
            chunk = slice(first, min(first + self.experts_per_encode, self.num_experts))
            chunk_drafts = [Int4Linear(d.qweight[chunk], d.scales[chunk], d.group_size) for d in drafts]
            weights = [gate_up[chunk].to(device), down[chunk].to(device)]
            blobs += [blob.cpu() for blob in encode_experts(weights, chunk_drafts, self.max_weights)]
            del weights
        sizes = [blob.numel() for blob in blobs]
        self.offsets.append([sum(sizes[:e]) for e in range(len(sizes) + 1)])
        self.buffers.append(pin(torch.cat(blobs), device))
        self.drafts.append(drafts)

    def finish(self) -> ResidualExpertStore:
        """The store of every layer added, its decode kernel checked bit for bit on this GPU."""
        if len(self.buffers) != self.num_layers:
            raise SpecterError(f"the residual store has {len(self.buffers)} of its {self.num_layers} layers")
        residuals = ResidualExpertStore(self.layout, self.dtype, self.drafts, self.buffers, self.offsets)
        residuals.check_kernel(self.checked)
        return residuals

"""Cold experts on the CPU during verification: which planned experts run there, the cost model, the worker.

A planned expert that is not resident costs one load over PCIe (`copy_ms`), or on the host
`fixed_ms + per_token_ms * tokens` with its rows crossing instead (hidden rows to the host, outputs back:
kilobytes). `split_for_host` gives the host the experts the draft routed the fewest tokens to, as long as
the host path's time stays within the time the copy stream needs for the rest, so both paths end
together. `HostExpertRunner` computes them in a worker thread (torch's CPU kernels, which use the
intra-op thread pool and release the GIL) from the host store's 16-bit weights, while the main thread
goes on queueing the GPU waves.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from specter.kernels.reference import expert_mlp
from specter.offload.host_store import HostExpertStore

DEFAULT_H2D_BYTES_PER_MS = 25e6  # until the run has measured its copies (25 GB/s)


@dataclass(frozen=True)
class HostCost:
    """CPU milliseconds of one expert for `tokens` tokens: fixed_ms + per_token_ms * tokens; the copy rate the
    split weighs them against (`copy_bytes_per_ms`; None: the run's measured H2D rate)."""

    fixed_ms: float
    per_token_ms: float
    copy_bytes_per_ms: float | None = None

    def cpu_ms(self, tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * tokens


def measure_host_cost(store: HostExpertStore, act, repeats: int = 3, tokens: tuple = (1, 16)) -> HostCost:
    """Time experts of the store on the host at 1 and 16 tokens (the median of `repeats`), as a line.

    Each call runs another expert (`cold_experts`), so its weights come from memory, not from the CPU's
    caches, as a cold expert's do during a run (a store of fewer experts than calls repeats some)."""
    experts = cold_experts(store, len(tokens) * (repeats + 1))
    medians = []
    for count in tokens:
        x = torch.zeros(count, store.hidden, dtype=store.dtype)
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            gate_up, down = store.split(store.expert(*next(experts)))
            start = time.perf_counter()
            expert_mlp(x, gate_up, down, act)
            times.append((time.perf_counter() - start) * 1e3)
        medians.append(sorted(times[1:])[len(times[1:]) // 2])
    per_token = max(0.0, (medians[1] - medians[0]) / (tokens[1] - tokens[0]))
    return HostCost(max(0.0, medians[0] - per_token * tokens[0]), per_token)


def cold_experts(store: HostExpertStore, count: int):
    """`count` (layer, expert) pairs of the store, spread over its layers and experts, each once if it has
    that many (else again from the first)."""
    total = store.num_layers * store.num_experts
    for i in range(count):
        index = (i * max(1, total // count)) % total
        yield divmod(index, store.num_experts)


def split_for_host(candidates: list[tuple[int, int]], cost: HostCost, copy_ms: float) -> set[int]:
    """The experts of `candidates` ((expert, draft tokens), none of them resident) to run on the host: fewest
    tokens first, while the host's total time stays within the copy stream's time for the rest."""
    host, host_ms, copy_total = set(), 0.0, copy_ms * len(candidates)
    for expert, tokens in sorted(candidates, key=lambda pair: (pair[1], pair[0])):
        if host_ms + cost.cpu_ms(max(tokens, 1)) > copy_total - copy_ms:
            break
        host.add(expert)
        host_ms += cost.cpu_ms(max(tokens, 1))
        copy_total -= copy_ms
    return host


def set_thread_count(threads: int) -> None:
    """torch's intra-op threads of the calling thread: torch first gives the thread the process's count
    (a thread takes it on its first query), then the thread keeps its own."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


class HostExpertRunner:
    """Computes experts on the host in one worker thread; `submit` returns a Future of (pairs, rows).

    pairs: [n] int64, the (token, slot) indices of the top-k routing the experts were routed to; rows:
    [n, H] float32, their outputs (None, None when the target routed none of them).
    """

    def __init__(self, store: HostExpertStore, cost: HostCost | None = None, act=None, threads: int = 0) -> None:
        """`cost`, or by default one measured (`measure_host_cost` with `act`) in the worker thread that runs
        the experts, in the mode they run in; `threads`: torch's intra-op threads there (0: torch's count;
        the setting is the thread's own, so the main thread keeps its count)."""
        self.store, self.threads = store, threads
        own = torch.get_num_threads()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specter-host-experts",
                                       initializer=set_thread_count, initargs=(threads or own,))
        self.pool.submit(int).result()  # the worker thread exists and has its count
        torch.set_num_threads(own)  # torch hands the last count set to threads made later: this thread's again
        self.cost = cost or self.pool.submit(torch.inference_mode()(measure_host_cost), store, act).result()

    def submit(self, layer: int, experts: set, hidden, routing, act) -> Future:
        """Run `experts` of `layer` once `hidden` ([T, H]) and `routing` ([T, k]) are on the host (HostReads)."""
        return self.pool.submit(self._run, layer, sorted(experts), hidden, routing, act)

    @torch.inference_mode()  # thread-local: the caller's mode does not reach the worker
    def _run(self, layer: int, experts: list[int], hidden, routing, act):
        x, top_k = hidden.result(), routing.result()
        k, flat = top_k.shape[1], top_k.reshape(-1)  # [T*k]
        pairs, rows = [], []
        for expert in experts:
            routed = (flat == expert).nonzero().squeeze(1)  # [n_e]
            if routed.numel():
                gate_up, down = self.store.split(self.store.expert(layer, expert))
                pairs.append(routed)
                rows.append(expert_mlp(x[routed // k], gate_up, down, act).float())  # [n_e, H]
        return (torch.cat(pairs), torch.cat(rows)) if pairs else (None, None)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

"""Expert cache: a fixed number of FP16 slots per MoE layer on the device, protection, event-guarded reuse."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from specter.kernels.residual_decode import group_rows
from specter.offload.cache_counters import PREFETCH, CacheCounters
from specter.offload.decode_groups import DecodeGroup
from specter.offload.host_store import HostExpertStore
from specter.offload.streams import DeviceStreams

DEMAND = "demand"


@dataclass
class LayerSlots:
    """Residency state of one layer's slots."""

    size: int
    first_row: int = 0  # the pool row of slot 0 before any load (the slots start on consecutive rows)
    own: int | None = None  # slots with a pool row at rest (None: all); the others hold spare rows lent to a verify
    rows: list = field(default_factory=list)  # slot -> pool row holding its expert
    expert_of: list = field(default_factory=list)  # slot -> expert id or None
    slot_of: dict = field(default_factory=dict)  # expert id -> slot
    lru: OrderedDict = field(default_factory=OrderedDict)  # slots, least recently used first
    protected: list = field(default_factory=list)  # slot -> number of queued/running users
    ready: list = field(default_factory=list)  # slot -> copy-finished event
    last_use: list = field(default_factory=list)  # slot -> event after the last kernel reading it
    loaded_by: list = field(default_factory=list)  # slot -> PREFETCH / DEMAND / None
    released: list = field(default_factory=list)  # slot -> sequence number of its last release (launch)
    read_in: list = field(default_factory=list)  # slot -> last window whose verification read its expert (-1: none)

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        n, own = self.size, self.size if self.own is None else self.own
        self.rows = list(range(self.first_row, self.first_row + own)) + [None] * (n - own)  # None: no row yet
        self.expert_of, self.slot_of = [None] * n, {}
        self.lru = OrderedDict((s, None) for s in range(n))
        self.protected, self.ready, self.last_use, self.loaded_by = [0] * n, [None] * n, [None] * n, [None] * n
        self.released, self.read_in = [0] * n, [-1] * n

    def unprotected_lru(self) -> list[int]:
        """Unprotected slots with a row, least recently used first (what victim policies choose from)."""
        return [s for s in self.lru if not self.protected[s] and self.rows[s] is not None]

    def rowless(self) -> int | None:
        """A slot without a row (it borrows a spare when loaded), or None."""
        return next((s for s in self.lru if self.rows[s] is None), None)


class SpareRow(NamedTuple):
    """A pool row that holds no resident expert: free once `last_use` (its last reader) has passed."""

    row: int
    last_use: object  # event after the last kernel reading it, or None
    ready: object  # its last copy's event, or None


class NoFreeSlot(RuntimeError):
    """Every slot of the layer is protected: compute queued work first, then load."""


class ExpertCache:
    """`slots_per_layer` FP slots per MoE layer, allocated once on the device.

    `acquire` makes an expert resident (loading it on a miss) and protects its slot; `release`
    records the last-use event and unprotects it. A copy overwrites a device row only after the
    last-use event of that row's last readers (the copy stream waits for it), so no kernel ever reads a
    row being refilled. `policy` (specter.offload.eviction) picks victims; callers pass what a load must
    keep.

    Every slot is a row of one device pool [layers x slots + spare_rows, 3*I*H]. With spare rows (shared
    by all layers, as Mixtral-Offloading's staging buffers), a load lands in the spare row released
    longest ago and the victim's row becomes a spare (a pointer swap): the copy waits for that spare's
    last readers, not for the kernels still reading the victim, so the copy stream need not idle while
    a verify wave computes. A layer still holds `slots_per_layer` experts at most.

    With `pooled`, each layer also has `spare_rows` slots without a row of their own: a verify layer streams
    through them too (`load_if_free` lends each a spare row while one is left), and `return_lent_rows` gives the
    rows back when the layer is done (its least recently used experts beyond `slots_per_layer` evicted).

    With `coded` (CodedSlots), the rows are blob rows: a load copies the expert's residual blob, and `wave_rows`
    rebuilds a wave's experts into the scratch rows (`pool`) just before the wave's kernel.
    """

    def __init__(self, store: HostExpertStore, slots_per_layer: int, device: torch.device,
                 streams: DeviceStreams, policy, spare_rows: int, residuals=None, decode_group: int = 1,
                 pooled: bool = False, coded=None) -> None:
        if spare_rows < 0:
            raise ValueError(f"spare_rows must be >= 0, got {spare_rows}")
        self.store, self.streams, self.slots_per_layer = store, streams, slots_per_layer
        self.residuals = residuals  # a ResidualExpertStore: loads move residual blobs (None: raw experts)
        self.coded = coded  # CodedSlots: the slots hold residual blobs, rebuilt per verify wave (None: 16-bit slots)
        decodes_loads = residuals is not None and coded is None  # coded slots decode per wave, in CodedSlots
        self.decode_launcher = residuals.launcher() if decodes_loads else None
        self.key = (slots_per_layer, policy.name, spare_rows, residuals is not None,
                    decode_group if residuals is not None else None, pooled,
                    0 if coded is None else len(coded.scratch_rows))  # offload_experts compares
        grouped = self.decode_launcher is not None and decode_group > 1  # one decode launch per `decode_group` loads
        self.decode_groups = [DecodeGroup(layer, decode_group, partial(self._decode_group, layer))
                              for layer in range(store.num_layers)] if grouped else None
        self.policy, self.spare_rows, self.pooled = policy, spare_rows, pooled
        rows = store.num_layers * slots_per_layer + spare_rows
        if coded is not None and coded.blobs.shape[0] != rows:
            raise ValueError(f"coded slots hold {coded.blobs.shape[0]} blob rows, this cache has {rows}")
        self.pool = coded.scratch if coded is not None else \
            torch.empty(rows, store.numel, dtype=store.dtype, device=device)  # [L*S + spare, 3*I*H]
        self.pool_rows = self.pool.unbind(0)  # each row's view, made once (a load indexes no tensor)
        size = slots_per_layer + (spare_rows if pooled else 0)
        self.layers = [LayerSlots(size, first_row=layer * slots_per_layer, own=slots_per_layer)
                       for layer in range(store.num_layers)]
        self.reset()

    def reset(self) -> None:
        """Empty every slot (the same initial state before each input) and zero the counters."""
        for slots in self.layers:
            slots.clear()
        first_spare = len(self.layers) * self.slots_per_layer
        self.spares = deque(SpareRow(row, None, None) for row in range(first_spare, first_spare + self.spare_rows))
        self.releases = 0  # launches whose slots were released (LayerSlots.released numbers them)
        self.counters = CacheCounters()
        self.window = 0  # decode windows begun (LayerSlots.read_in numbers them)
        self.begin_window()

    def begin_window(self) -> None:
        """A decode window starts: forget which experts its evictions removed (for the reload counters)."""
        self.evicted_by: dict[tuple[int, int], str] = {}  # (layer, expert) -> cause of its eviction
        self.window += 1

    @property
    def load_bytes(self) -> float:
        """Bytes one expert load moves over PCIe (the mean blob with residual transfer)."""
        return self.store.expert_bytes if self.residuals is None else self.residuals.mean_blob_bytes

    @property
    def device_bytes(self) -> int:
        if self.coded is not None:
            return self.coded.device_bytes
        return self.pool.numel() * self.pool.element_size()

    @property
    def max_wave(self) -> int | None:
        """Most experts one verify wave may read (coded slots: the scratch rows; None: no bound)."""
        return None if self.coded is None else len(self.coded.scratch_rows)

    def free(self) -> None:
        """Drop the device pool (before a new cache is allocated in its place) once no copy or decode still
        writes into it (pending grouped decodes run first); the cache is unusable after."""
        self.streams.synchronize()
        self.pool = torch.empty(0, self.store.numel, dtype=self.store.dtype, device=self.pool.device)
        self.pool_rows = ()
        if self.coded is not None:
            self.coded.free()
        if self.decode_launcher is not None:
            self.decode_launcher.unbind()  # its bound launches hold the old pool

    def row(self, layer: int, slot: int) -> int:
        """The pool row that holds `slot`'s expert (it changes when the slot is loaded with spare rows)."""
        return self.layers[layer].rows[slot]

    def slot_of(self, layer: int, expert: int) -> int | None:
        return self.layers[layer].slot_of.get(expert)

    def resident_experts(self, layer: int) -> set:
        return set(self.layers[layer].slot_of)

    @property
    def stream_slots(self) -> int:
        """Slots a verify layer streams through: its own, and the spare rows with `pooled`."""
        return self.layers[0].size if self.layers else self.slots_per_layer

    def load_if_free(self, layer: int, expert: int) -> int | None:
        """`load` into a slot without a row while a spare row is left to lend it, else into the policy's victim
        slot; None (nothing started) if every slot is protected."""
        slots = self.layers[layer]
        slot = slots.rowless() if self.pooled and self.spares else None
        if slot is None:
            slot = self.policy.stream_victim(layer, slots)
        return None if slot is None else self.load(layer, expert, slot)

    def return_lent_rows(self, layer: int) -> None:
        """A verify layer is done: its unprotected slots, least recently used first, give the rows lent to it back
        to the spares until it holds `slots_per_layer` rows (their experts evicted; no-op without pooled slots)."""
        slots = self.layers[layer]
        excess = sum(row is not None for row in slots.rows) - self.slots_per_layer
        for slot in slots.unprotected_lru()[:max(0, excess)]:
            expert = slots.expert_of[slot]
            if expert is not None:
                del slots.slot_of[expert]
                self.counters.evictions += 1
                self.evicted_by[layer, expert] = "verify"
            self.spares.append(SpareRow(slots.rows[slot], slots.last_use[slot], slots.ready[slot]))
            slots.rows[slot] = slots.expert_of[slot] = slots.loaded_by[slot] = None
            slots.last_use[slot] = slots.ready[slot] = None

    def acquire(self, layer: int, expert: int) -> int:
        """Slot holding `expert` (loaded on a miss), protected until `release`; counts a hit or a miss."""
        slots = self.layers[layer]
        slot = slots.slot_of.get(expert)
        if slot is None:
            slot = self._load(layer, expert, DEMAND)
            self.counters.misses += 1
        else:
            self.counters.hits += 1
            if slots.loaded_by[slot] == PREFETCH:
                self.counters.hits_prefetched += 1
                slots.loaded_by[slot] = DEMAND  # counted once
        slots.protected[slot] += 1
        slots.lru.move_to_end(slot)
        slots.read_in[slot] = self.window
        return slot

    def protect_resident(self, layer: int) -> dict[int, int]:
        """Expert -> slot of every resident expert, each slot protected until `release` (no lookup counted)."""
        slots = self.layers[layer]
        resident = dict(sorted(slots.slot_of.items()))
        for slot in resident.values():
            slots.protected[slot] += 1
        return resident

    def load(self, layer: int, expert: int, slot: int | None = None) -> int:
        """Load a non-resident expert on the verify path (into `slot`, else the policy's victim); its slot
        is protected until `release`. Lookups are counted afterwards by `count_lookups`, once the
        router's choice is known."""
        slot = self._load(layer, expert, DEMAND, slot)
        slots = self.layers[layer]
        slots.protected[slot] += 1
        slots.lru.move_to_end(slot)
        slots.read_in[slot] = self.window
        return slot

    def load_ahead(self, layer: int, expert: int, keep: frozenset) -> bool:
        """Start loading `expert` into an unprotected slot whose expert is not in `keep` (a layer's
        verification plan); False if there is none. Not protected: nothing runs on the layer before it."""
        loaded = self._load_unless_kept(layer, expert, DEMAND, keep, cause="ahead")
        self.counters.loads_ahead += loaded
        return loaded

    def count_lookups(self, layer: int, routed: list[int], resident: dict[int, int], planned: set,
                      prefetched: set) -> None:
        """Hits and misses of one verify layer once its routing is read.

        resident: what was resident when the layer started; planned: experts loaded before the routing
        was read, on the draft's prediction; prefetched: resident experts the planner had brought in.
        """
        slots, routed_set, counters = self.layers[layer], set(routed), self.counters
        hits = routed_set & resident.keys()
        counters.hits += len(hits)
        counters.hits_prefetched += len(hits & prefetched)
        counters.misses += len(routed_set) - len(hits)
        counters.misses_planned += len(routed_set & planned)
        counters.wasted_loads += len(planned - routed_set)
        for expert in sorted(hits):
            slot = slots.slot_of.get(expert)
            if slot is not None:
                slots.loaded_by[slot] = DEMAND  # a prefetched expert counts once
                slots.lru.move_to_end(slot)
                slots.read_in[slot] = self.window

    def prefetched_experts(self, layer: int) -> set:
        """Resident experts the planner loaded and no verification has used yet."""
        slots = self.layers[layer]
        return {e for e, s in slots.slot_of.items() if slots.loaded_by[s] == PREFETCH}

    def prefetch(self, layer: int, expert: int, keep: frozenset = frozenset(),
                 predicted: frozenset = frozenset()) -> bool:
        """Start loading `expert` unless resident; False if every unprotected slot holds an expert of `keep`
        (this window's plan) or of `predicted` (the experts the window's draft has routed to): a prefetch
        only replaces an expert with no sign of being needed, since evicting a predicted one would just
        move its load into verification."""
        slots = self.layers[layer]
        if expert in slots.slot_of:
            return True
        loaded = self._load_unless_kept(layer, expert, PREFETCH, keep | predicted, predicted=predicted)
        self.counters.prefetch_loads += loaded
        return loaded

    def _load_unless_kept(self, layer: int, expert: int, reason: str, keep: frozenset, cause: str = PREFETCH,
                          predicted: frozenset = frozenset()) -> bool:
        slots = self.layers[layer]
        slot = self.policy.victim(layer, slots, keep, predicted)
        if slot is None:
            return False
        self._load(layer, expert, reason, slot, cause)
        slots.lru.move_to_end(slot)
        return True

    def touch(self, layer: int, expert: int) -> None:
        """Mark a resident expert most recently used (no-op if not resident)."""
        slot = self.layers[layer].slot_of.get(expert)
        if slot is not None:
            self.layers[layer].lru.move_to_end(slot)

    def release(self, layer: int, slot: int) -> None:
        """The kernels reading `slot` are enqueued: remember when they end, unprotect the slot."""
        self.release_all(layer, [slot])

    def release_all(self, layer: int, slots_read: list[int]) -> None:
        """`release` for the slots one launch read: one last-use event for all of them."""
        slots, last_use = self.layers[layer], self.streams.record()
        self.releases += 1
        for slot in slots_read:
            slots.last_use[slot], slots.released[slot] = last_use, self.releases
            slots.protected[slot] -= 1

    def ready_event(self, layer: int, slot: int):
        return self.layers[layer].ready[slot]

    def wave_rows(self, layer: int, wave: list[tuple[int, int]]) -> list[int]:
        """The pool rows holding a wave's experts ((expert, slot) pairs whose copies the compute stream has waited
        for): the slots' rows, or with coded slots the scratch rows their blobs are rebuilt into now."""
        rows = [self.row(layer, slot) for _, slot in wave]
        if self.coded is None:
            return rows
        return self.coded.rebuild(self.streams, layer, [(expert, row) for (expert, _), row in zip(wave, rows)])

    def weights(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) views of a slot's expert (coded slots: rebuilt into a scratch row)."""
        row, = self.wave_rows(layer, [(self.layers[layer].expert_of[slot], slot)])
        return self.store.split(self.pool_rows[row])

    def _load(self, layer: int, expert: int, reason: str, slot: int | None = None, cause: str = "verify") -> int:
        slots = self.layers[layer]
        slot = self.policy.victim(layer, slots) if slot is None else slot
        if slot is None:
            raise NoFreeSlot(f"layer {layer}: all {slots.size} slots are protected")
        old = slots.expert_of[slot]
        if old is not None:
            del slots.slot_of[old]
            self.counters.evictions += 1
            self.evicted_by[layer, old] = cause
        earlier = self.evicted_by.pop((layer, expert), None)
        if earlier is not None:
            self.counters.count_reload(earlier)
        slots.expert_of[slot], slots.slot_of[expert], slots.loaded_by[slot] = expert, slot, reason
        slots.read_in[slot] = -1  # the caller marks a verification read
        target = self._swap_in_spare(slots, slot)
        waits = dict(after=target.last_use, demand=reason == DEMAND, previous=target.ready)
        if self.coded is not None:
            slots.ready[slot] = self.coded.copy_in(self.streams, target.row, layer, expert, **waits)
        elif self.residuals is None:
            slots.ready[slot] = self.streams.copy(self.pool_rows[target.row], self.store.expert(layer, expert), **waits)
        else:
            group = None if self.decode_groups is None else self.decode_groups[layer]
            decode = None if group else partial(self.residuals.decode, layer, expert, self.decode_launcher)
            blob = self.residuals.blob(layer, expert)
            slots.ready[slot] = self.streams.copy_decoded(self.pool_rows[target.row], blob, decode,
                                                          self.residuals.max_blob_words, **waits, group=group,
                                                          member=expert)
        return slot

    def _decode_group(self, layer: int, staging: torch.Tensor, items: list[tuple]) -> None:
        """One launch decoding a group of this layer's loads (`DecodeGroup.launch`), its table on the device."""
        table = self.streams.upload_rows(group_rows(items, self.pool), 4, ring="decode")  # [n, 4]
        self.residuals.decode_group(layer, self.decode_launcher, staging, self.pool, table)

    def start_loads(self) -> None:
        """Start the copies of grouped loads that wait for their group's launch (`group_copies`; else nothing)."""
        self.streams.start_copies()

    def flush_loads(self) -> None:
        """Start the decodes of loads still waiting for their group (grouped residual loads; else nothing)."""
        self.streams.flush_decodes()

    def _swap_in_spare(self, slots: LayerSlots, slot: int) -> SpareRow:
        """The row a load into `slot` writes: the spare released longest ago, the slot's old row becoming a
        spare (free once its readers are done); without spares, the slot's own row."""
        own = SpareRow(slots.rows[slot], slots.last_use[slot], slots.ready[slot])
        if not self.spares:
            return own
        spare = self.spares.popleft()
        if own.row is not None:  # a slot without a row (`pooled`) keeps the spare until `return_lent_rows`
            self.spares.append(own)
        slots.rows[slot], slots.last_use[slot] = spare.row, spare.last_use
        return spare

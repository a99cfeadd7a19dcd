"""The served model: loaded once (with a progress bar), and a SpecterEngine per sampling setting built over it."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specter.config import SpecterConfig
from specter.engine import SpecterEngine
from specter.models.hybrid import HybridMoEModel
from specter.models.loading import check_model_source, load_model
from specter.text import generate_text

GREEDY = (0.0, 1.0, 0)  # every greedy request decodes on this engine: top_p and seed do not change its tokens
MAX_SAMPLING_ENGINES = 8  # sampling engines kept (least recently used goes first)
WARM_UP = "Hello"


@dataclass
class ServedModel:
    """One loaded model as the server offers it: the name /v1/models lists (and the other names it answers to),
    and its engines, built as `python -m specter generate` builds its engine: K and resident slots fixed, one
    engine per (temperature, top_p, seed). Only the scheduler's worker thread calls `engine_for`."""

    name: str
    model: HybridMoEModel
    k: int | None
    slots: int | None
    aliases: frozenset[str] = frozenset()
    engines: OrderedDict = field(default_factory=OrderedDict)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def max_positions(self) -> int | None:
        return self.model.max_positions

    def knows(self, name: str) -> bool:
        return name == self.name or name in self.aliases

    def engine_for(self, temperature: float, top_p: float, seed: int) -> SpecterEngine:
        key = GREEDY if temperature == 0 else (float(temperature), float(top_p), int(seed))
        if key in self.engines:
            self.engines.move_to_end(key)
            return self.engines[key]
        sampling = [k for k in self.engines if k != GREEDY]
        if len(sampling) >= MAX_SAMPLING_ENGINES:
            del self.engines[sampling[0]]
        config = SpecterConfig(k=self.k, resident_experts_per_layer=self.slots, temperature=key[0], top_p=key[1],
                               seed=key[2])
        self.engines[key] = SpecterEngine(self.model, config, keep_raw_experts=False)  # the host keeps blobs only
        return self.engines[key]


def load_served(source: str, slots_for: Callable[[HybridMoEModel], int], k: int | None = None,
                device: str | None = None, dtype: torch.dtype | None = None, progress: bool = True) -> ServedModel:
    """Load `source` (a registered name or a checkpoint directory) for serving, as `python -m specter generate`
    does (`slots_for(model)`: its resident expert slots per layer), build the greedy engine and warm it up with
    a two-token decode, alone and as a batch of two; a progress bar follows the three steps."""
    check_model_source(source)
    with tqdm(total=3, desc=f"loading {source}", unit="step", disable=not progress, leave=True) as bar:
        bar.set_postfix_str("model")
        model = load_model(source, device=device, dtype=dtype, keep_raw_experts=False)  # Specter alone
        bar.update()
        bar.set_postfix_str("engine")
        served = ServedModel(str(source), model, model.spec.default_k if k is None else k, slots_for(model),
                             aliases(source, model))
        engine = served.engine_for(*GREEDY)
        bar.update()
        bar.set_postfix_str("warm-up")
        generate_text(engine, WARM_UP, 2)
        engine.generate([model.tokenizer.encode(WARM_UP)] * 2, 2)  # the batch path's first call is slow too
        bar.update()
        bar.set_postfix_str("ready")
    return served


def aliases(source: str, model: HybridMoEModel) -> frozenset[str]:
    """The names a request may give besides `source`: the registered spec's name (tiny-dsv2 for tiny) and a
    checkpoint directory's own name."""
    names = {model.spec.name}
    if Path(source).is_dir():
        names.add(Path(source).resolve().name)
    return frozenset(names)

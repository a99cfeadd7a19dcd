"""One generate() call's runtime, passed to what needs it: the offload session (whose residency manager each target
forward is given), the window accounting and the sampling generator; it is the window loop's `Windows`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specter.speculative.sampling import seeded_generator
from specter.window_accounting import WindowAccounting


@dataclass
class DecodeCall:
    """A call's offload session (`offload.runtime.OffloadSession`; None: every expert resident), its requests'
    window accounting and the generator its sampling draws from (None: greedy)."""

    session: Any
    accounting: WindowAccounting
    generator: torch.Generator | None

    @classmethod
    def start(cls, session, config, device: torch.device) -> DecodeCall:
        """A new call: fresh accounting, the generator seeded from `config` (temperature, seed)."""
        return cls(session, WindowAccounting(session), seeded_generator(config, device))

    def end_prefill(self) -> None:
        """The prefill is not a verify window (its copies are counted apart)."""
        self.accounting.end_prefill()

    def begin_window(self) -> None:
        """A window begins: its resident experts (I/O floor) and the cache's window for reload counts."""
        self.accounting.begin_window()
        if self.session is not None:
            self.session.cache.begin_window()

    @property
    def executor(self):
        """What runs the call's target forwards outside a window (its prefill): the session's residency manager,
        loading on demand (None: the model's own experts)."""
        return None if self.session is None else self.session.residency

    def verifier(self, plan):
        """The target executor of a window's target pass: the call's residency manager with the window's `plan`
        (None: the model's own experts)."""
        return None if self.session is None else self.session.residency.window(plan)

    def close_window(self, plan, committed=None) -> None:
        """After a window's commit: the target's routing against the plan, the working set and the I/O floor."""
        self.accounting.close_window(plan)

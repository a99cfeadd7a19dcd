"""Defaults of SpecterConfig's fields for the modules that take some of them one by one (one place per default)."""
from __future__ import annotations

from specter.config import SpecterConfig


def config_default(name: str):
    """SpecterConfig's default value of field `name`."""
    fields = SpecterConfig.__dataclass_fields__
    if name not in fields:
        raise KeyError(f"SpecterConfig has no field {name!r}")
    return fields[name].default

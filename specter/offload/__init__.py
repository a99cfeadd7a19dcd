"""Device runtime: timing, host synchronisation, and (with the offload runtime) host store and expert cache."""
from specter.offload.timeline import Timeline, to_host

__all__ = ["Timeline", "to_host"]

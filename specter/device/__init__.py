"""Device utilities every part uses: timing and host synchronisation, copy/compute overlap in a profiler trace,
and the GPU memory budget."""
from specter.device.timeline import Timeline, to_host

__all__ = ["Timeline", "to_host"]

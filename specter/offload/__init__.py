"""The offload runtime: host store, expert cache, copy streams, residual transfer."""

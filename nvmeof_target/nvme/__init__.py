"""The NVMe/TCP front: listener, queue pairs, the Fabrics/Admin/KV command handlers, subsystems."""

"""`bench fuzz`: mutated native frames and NVMe/TCP PDUs at a live daemon while a good client
measures what the fuzz costs it."""

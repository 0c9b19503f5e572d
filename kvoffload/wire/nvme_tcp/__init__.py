"""NVMe/TCP and the NVMe Key Value command set, sans-I/O: PDUs, commands, data, one connection."""

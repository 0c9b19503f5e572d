"""The native protocol (DESIGN §5), sans-I/O: frames, events and their fields, one connection."""

"""The storage daemon (`kvoffload serve`): native and NVMe/TCP fronts over the engine.

Not built yet: the daemon and its fronts are the subject of later issues.
"""

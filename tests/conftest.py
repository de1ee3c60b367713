"""Suite-wide settings.

Hypothesis' default 200 ms deadline per example fails a property when a busy neighbour
process slows this one down; no test of ours may depend on the machine's speed, so the
deadline is off for every property (explicit ``@settings`` inherit this profile).
"""
from hypothesis import settings

settings.register_profile("ms_memopt", deadline=None)
settings.load_profile("ms_memopt")

"""Checkpoints: `store` writes and reads them (DCP shards, manifest, atomic commit, fallback);
`manager` decides what goes into one and when, given its state objects explicitly.

`from disttrain import checkpoint; checkpoint.save(...)` keeps working: the storage functions are
re-exported here. The manager is imported from `disttrain.checkpoint.manager` where it is used.
"""

from disttrain.checkpoint.store import *  # noqa: F403

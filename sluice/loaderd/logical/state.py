"""The data state, re-exported for the logical plane.

It lives in the shared leaf `sluice.datastate` (imported by the daemon, the
client side and the trainer hooks alike); this module keeps the logical
plane's imports short and stable.
"""

from sluice.datastate import (
    MAX_STATE_INT,
    STATE_KIND,
    STATE_SCHEMA,
    DataState,
    LaneState,
    SourceCursor,
    StateBounds,
    check_bounds,
    lane_obj,
    state_obj,
)

__all__ = ["MAX_STATE_INT", "STATE_KIND", "STATE_SCHEMA", "DataState", "LaneState", "SourceCursor", "StateBounds",
           "check_bounds", "lane_obj", "state_obj"]

"""Keep the Ray instance of a local cluster on 127.0.0.1, not on the machine's network address."""

from __future__ import annotations

import os
import sys

RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch that, set to ``0``, makes a node use the loopback address as its node address.

Ray otherwise advertises (and its gRPC servers listen on) the machine's network address even for
a single-machine instance. Ray reads the variable when it is imported, so the module constant is
updated too when Ray is already imported. Multi-node clusters (not built yet) must not use this.
"""


def keep_ray_on_loopback() -> None:
    """Make the Ray instance this process starts or joins use 127.0.0.1 as its node address.

    Does nothing when the user set ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` explicitly.
    """
    if RAY_LOOPBACK_ENV in os.environ:
        return
    os.environ[RAY_LOOPBACK_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False

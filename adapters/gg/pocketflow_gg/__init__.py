"""pocketflow for gg: gg's object model (content names, thunks), inferring a make build as a
thunk graph, and forcing it on Lithops functions or Ray tasks whose inputs and outputs live in
pocketflow. See adapters/gg/README.md."""

from pocketflow_gg.errors import (
    GGError,
    InferError,
    InvalidName,
    InvalidThunk,
    MissingObject,
    ThunkFailed,
)
from pocketflow_gg.force import ForceResult, fetch_outputs, force, hints_for
from pocketflow_gg.infer import BuildGraph, infer
from pocketflow_gg.objects import content_name, file_name, placeholder
from pocketflow_gg.store import PocketflowStore, RedisStore, open_store
from pocketflow_gg.thunk import Thunk

__all__ = [
    "BuildGraph", "ForceResult", "GGError", "InferError", "InvalidName", "InvalidThunk",
    "MissingObject", "PocketflowStore", "RedisStore", "Thunk", "ThunkFailed", "content_name",
    "fetch_outputs", "file_name", "force", "hints_for", "infer", "open_store", "placeholder",
]

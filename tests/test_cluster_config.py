"""examples/cluster.yaml passes Ray's own cluster-config validation (the autoscaler's defaults
and JSON schema, as `ray up` applies them), and its node types carry the resources pocketflow
places storage servers by."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pocketflow.cli import build_parser
from pocketflow.control.launcher import tier_resource

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "cluster.yaml"


def test_the_example_cluster_config_passes_rays_validation() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    # What `ray up` does first: fill the provider's defaults, then check against the schema.
    validate_config(prepare_config(config))  # raises on a schema violation


def test_storage_node_types_advertise_one_slot_of_their_tier() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    types = config["available_node_types"]
    assert types["storage-dram"]["resources"][tier_resource("dram")] == 1
    assert types["storage-nvme"]["resources"][tier_resource("nvme")] == 1
    assert not any(k.startswith("pocketflow_storage") for k in types["head"]["resources"])
    assert sum(t.get("max_workers", 0) for t in types.values()) >= config["max_workers"]


def test_the_start_command_parses_with_the_cli() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    command = next(c for c in config["head_start_ray_commands"] if "pocketflow up" in c)
    argv = command.split("pocketflow ", 1)[1].split(">")[0].split()
    args = build_parser().parse_args(argv)
    assert args.address == "auto" and args.work_dir == "/mnt/pocketflow" and args.autoscale


def test_rays_validation_catches_a_broken_copy() -> None:
    import copy

    import jsonschema
    import pytest

    config = yaml.safe_load(CONFIG.read_text())
    broken = copy.deepcopy(config)
    broken["available_node_types"]["storage-dram"]["resources"] = {"CPU": "many"}
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))

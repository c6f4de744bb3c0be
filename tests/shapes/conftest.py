"""The micro world with a base policy that plans, built once per session from the micro world's other stages."""

import pytest


@pytest.fixture(scope="session")
def plan_micro_build(micro_world, tmp_path_factory):
    """(the world's path, the build's messages): `world build --preset plan_micro --from <micro world>`."""
    from grpo_vision.shapes.build import build_world

    path = tmp_path_factory.mktemp("worlds") / "shapes_plan_micro"
    messages = []
    build_world(path, preset="plan_micro", seed=0, progress=False, log=messages.append, start_from=micro_world)
    return path, messages


@pytest.fixture(scope="session")
def plan_micro_world(plan_micro_build):
    return plan_micro_build[0]

"""What the model tests share: the tiny random Janus-Pro, built once per test session (its image path's tests and
its text stage's read it, never change it)."""

import pytest


@pytest.fixture(scope="session")
def janus_dir(tmp_path_factory):
    from tests.models.test_janus import build_tiny_janus

    return build_tiny_janus(tmp_path_factory.mktemp("janus") / "tiny_janus")

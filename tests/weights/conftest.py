"""The e2e cases here use the session's tiny model as `tests/e2e` does (one definition, shared)."""

from tests.e2e.conftest import tiny_model_dir  # noqa: F401

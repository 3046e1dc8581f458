from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo() -> Path:
    return REPO


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs two of these tests at a time (``pytest -n 2 --dist worksteal``): the
    default project's whole suite, most of the time, goes first, so that the rest runs beside
    it rather than after it (its suite leaves a core idle now and then)."""
    items.sort(key=lambda item: item.name != "test_generated_project_tests_pass")

"""Every test here needs the trainers extra: `trainers_extra` puts it in the `trainers` lane (support/lanes.py)."""

import pytest


@pytest.fixture(autouse=True)
def _needs_trainers(trainers_extra) -> None:
    pass

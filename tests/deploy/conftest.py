"""The rendered kustomizations, one module-scoped fixture per rendering."""

import pytest

from tests.deploy.contract import DEPLOY, RENDERINGS
from tests.deploy.kustomize import render


@pytest.fixture(scope="module", params=RENDERINGS)
def rendering(request) -> tuple[str, list[dict]]:
    """(name, objects) of one kustomization in deploy/."""
    return request.param, render(DEPLOY / request.param)

"""The suite covers every lineage step: a package built without them (pip install's default) is
told so at the start, instead of failing test by test."""

import pytest


def pytest_sessionstart(session):
    import hattn

    names = [k.name for k in hattn.kernels()]
    if len(names) == 1:
        pytest.exit(
            "hattn was built without the lineage (HATTN_LINEAGE=OFF, pip install's default); the tests cover "
            "every step: pip install . --config-settings=cmake.define.HATTN_LINEAGE=ON (scripts/test_python.sh "
            f"does). Kernels built: {names}",
            returncode=4,
        )

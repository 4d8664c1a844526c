"""Fixtures of the reward tests: ``backend`` runs a test under each sandbox backend."""

from __future__ import annotations

import pytest

from relayrl.rewards import sandbox


@pytest.fixture(params=sandbox.BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test under each sandbox backend ($RELAYRL_SANDBOX)."""
    if request.param == "bwrap" and not sandbox._bwrap_works():
        pytest.skip("bubblewrap is not installed or cannot create namespaces here")
    monkeypatch.setenv("RELAYRL_SANDBOX", request.param)
    assert sandbox.sandbox_backend() == request.param
    return request.param

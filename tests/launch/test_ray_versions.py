"""The version check of ``launcher: ray`` (driver vs the versions a Ray cluster recorded, or
a server actor reported) on recorded metadata; the end-to-end refusal is in
test_ray_launcher.py."""

from __future__ import annotations

from relayrl.launch.ray_cluster import version_mismatch


def test_version_mismatch_compares_what_ray_requires(monkeypatch):
    monkeypatch.delenv("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", raising=False)
    recorded = {"ray_version": "2.60.0", "python_version": "3.11.7", "ray_init_cluster": False}
    assert version_mismatch(recorded, "2.60.0", "3.11.7") is None
    assert version_mismatch({}, "2.60.0", "3.11.7") is None  # nothing recorded
    problem = version_mismatch(recorded, "2.59.1", "3.11.9")
    assert "Ray 2.60.0 there, 2.59.1 here; Python 3.11.7 there, 3.11.9 here" in problem
    monkeypatch.setenv("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", "minor")
    assert version_mismatch(recorded, "2.60.0", "3.11.9") is None  # patch level ignored
    assert "Python 3.11.7 there, 3.12.1 here" in version_mismatch(recorded, "2.60.0", "3.12.1")
    node = {**recorded, "relayrl_version": "0.1.0"}  # what a server actor reports
    assert "relayrl 0.1.0 there, 0.2.0 here" in version_mismatch(node, "2.60.0", "3.11.7", "0.2.0")
    assert version_mismatch(node, "2.60.0", "3.11.7", "0.1.0") is None

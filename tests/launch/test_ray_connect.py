"""The checks ``launcher: ray`` makes before ``ray.init`` (no Ray cluster needed): the form
of ``ray.address``, the bounded probe of its port, and the version comparison on recorded
metadata (driver vs what a cluster recorded or a server actor reported). The end-to-end
refusals on a live cluster are in test_ray_launcher.py."""

from __future__ import annotations

import socket
import time

import pytest

from relayrl.errors import RelayError
from relayrl.launch.ray_cluster import resolve_address, version_mismatch, wait_for_port


@pytest.mark.parametrize("bad", ["nohost", "10.0.0.1:", ":6379", "10.0.0.1:http", "h:70000"])
def test_a_malformed_address_is_one_error_naming_the_key(bad):
    with pytest.raises(RelayError, match=r"^ray.address=.*expected 'local', 'auto' or HOST:PORT"):
        resolve_address(bad)
    assert resolve_address("10.0.0.1:6379") == "10.0.0.1:6379"


def test_a_closed_port_fails_after_the_timeout_naming_what_was_tried():
    with socket.socket() as s:  # a loopback port that nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(RelayError) as err:
        wait_for_port(f"127.0.0.1:{port}", f"127.0.0.1:{port}", 1.2)
    took = time.monotonic() - start
    assert 0.9 < took < 30  # 1.2 s idle; generous for a loaded machine, far below a hang
    message = str(err.value)
    assert message.startswith(f"ray.address='127.0.0.1:{port}': no Ray head answers at ")
    assert "TCP connection attempts over 1s (ray.connect_timeout_s) failed, last with " in message
    assert "'Connection refused'" in message
    with socket.socket() as listening:  # and returns at once when something listens
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        wait_for_port(f"127.0.0.1:{listening.getsockname()[1]}", "x", 1.0)


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

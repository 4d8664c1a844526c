"""``relayrl inspect`` in a real headless browser (Debian's Chromium): the page loads, a
group renders, every token's colour is its weight version's, the URL hash's filter works,
and the report links each step to the inspector. Screenshots go to the test's tmp_path.
Skipped when no chromium is installed (``.ci/run`` installs it as root)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.report.inspect import PALETTE, inspector_data, serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium: apt-get install chromium (as .ci/run does)"
)

# two steps at trainer versions 0 and 3 (η = 2): step 2's group g2 mixes versions 1 and 3
SAMPLES = [
    (0, "g1", 0, 1.0, "stop", [0, 0, 0]),
    (0, "g1", 1, 0.0, "length", [0, 0, 0]),
    (3, "g2", 0, 1.0, "stop", [1, 1, 3]),
    (3, "g2", 1, 0.0, "stop", [3, 3, 3]),
    (3, "g2", 2, 1.0, "length", [2, 3, 3]),
]


def crafted_run(run: Path) -> Path:
    run.mkdir()
    samples, inspect = [], []
    for version, gid, index, reward, finish, versions in SAMPLES:
        samples.append(
            {
                "step": version,
                "trainer_version": version,
                "prompt_id": f"p-{gid}",
                "group_id": gid,
                "sample_index": index,
                "version_min": min(versions),
                "version_max": max(versions),
                "reward": reward,
                "advantage": reward - 0.5,
                "finish_reason": finish,
                "completion_tokens": 3,
                "prompt_text": f"prompt of {gid}",
                "text": "a<b",
            }
        )
        runs = [[v, versions.count(v)] for v in sorted(set(versions))]
        inspect.append(
            {
                "step": version,
                "trainer_version": version,
                "group_id": gid,
                "sample_index": index,
                "versions": runs,
                "behav": [-0.5, -1.0, -2.0],
                "prox": [-0.4, -1.0, -2.5],
                "pieces": ["a", "<", "b"],
            }
        )
    inspect.append({"step": 3, "replayed": [["g1", 0]]})  # D-ARL trained g1/0 again
    metrics = [{"step": v + 1, "version": v + 1, "reward_mean": 0.5} for v in (0, 3)]
    for name, rows in (("samples", samples), ("inspect", inspect), ("metrics", metrics)):
        (run / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


class Dom(HTMLParser):
    """The elements of a dumped DOM: (tag, attributes, text directly inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[list] = []
        self.stack: list[list] = []

    def handle_starttag(self, tag, attrs):
        element = [tag, dict(attrs), ""]
        self.elements.append(element)
        if tag not in ("br", "meta", "input", "img"):
            self.stack.append(element)

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self.stack:
            self.stack[-1][2] += data

    def find(self, cls: str) -> list[list]:
        return [e for e in self.elements if cls in e[1].get("class", "").split()]


def chromium(*args: str) -> str:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    out = subprocess.run(
        [*command, "--virtual-time-budget=5000", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def dump(url: str) -> Dom:
    dom = Dom()
    dom.feed(chromium("--dump-dom", url))
    return dom


def screenshot(url: str, png: Path) -> None:
    chromium("--window-size=1300,900", f"--screenshot={png}", url)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def page(tmp_path, capsys) -> tuple[Path, Path]:
    run = crafted_run(tmp_path / "run")
    assert main(["inspect", str(run)]) == 0
    html = run / "report" / "inspect.html"
    assert f"inspect: {html}" in capsys.readouterr().out
    assert "http" not in re.sub(r"https?://www\.w3\.org\S*", "", html.read_text())  # no CDN
    return run, html


def test_inspector_data_joins_tokens_and_replays(page):
    run, _ = page
    data = inspector_data(run)
    assert [s["step"] for s in data["steps"]] == [1, 4]
    g2 = data["steps"][1]["groups"][0]
    assert g2["id"] == "g2" and [s["stale"] for s in g2["samples"]] == [2, 0, 1]
    assert g2["samples"][0]["tok"]["v"] == [1, 1, 3]
    assert data["steps"][0]["groups"][0]["samples"][0]["replayed"] == [4]


@needs_chromium
def test_a_group_renders_with_tokens_coloured_by_version(page, tmp_path):
    _, html = page
    url = html.as_uri() + "#step=4"
    dom = dump(url)
    groups = dom.find("group")
    assert [g[1]["data-group"] for g in groups] == ["g2"]
    rows = dom.find("sample")
    assert [r[1]["data-index"] for r in rows] == ["0", "1", "2"]
    tokens = dom.find("tok")
    versions = [int(t[1]["data-version"]) for t in tokens]
    assert versions == [v for *_, vs in SAMPLES[2:] for v in vs]
    for t in tokens:
        assert t[1]["style"] == f"background:{PALETTE[int(t[1]['data-version']) % len(PALETTE)]}"
        assert "behaviour μ" in t[1]["title"] and "proximal π_v" in t[1]["title"]
    assert [t[2] for t in tokens[:3]] == ["a", "<", "b"]  # text, not markup
    assert "Δ +0.1000" in tokens[0][1]["title"]  # -0.4 − (−0.5)
    screenshot(url, tmp_path / "inspect_step4.png")


@needs_chromium
def test_filters_in_the_url_hash(page, tmp_path):
    _, html = page
    url = html.as_uri() + "#step=all&filter=reward>0,!truncated"
    dom = dump(url)
    shown = [(r[1]["data-reward"], r[1]["data-truncated"]) for r in dom.find("sample")]
    assert shown == [("1", "false"), ("1", "false")]  # g1/0 and g2/0
    assert [g[1]["data-group"] for g in dom.find("group")] == ["g1", "g2"]
    screenshot(url, tmp_path / "inspect_filtered.png")
    replayed = dump(html.as_uri() + "#step=all&filter=replayed")
    assert [(r[1]["data-index"]) for r in replayed.find("sample")] == ["0"]
    stale = dump(html.as_uri() + "#step=4&filter=staleness>=1")
    assert [r[1]["data-staleness"] for r in stale.find("sample")] == ["2", "1"]


@needs_chromium
def test_report_links_steps_to_the_inspector(page, tmp_path):
    run, _ = page
    assert main(["report", str(run)]) == 0
    report = run / "report" / "index.html"
    text = report.read_text()
    assert "href='inspect.html#step=4'" in text and "<table class='summary'>" in text
    screenshot(report.as_uri(), tmp_path / "report.png")


def test_serve_answers_with_the_key_only(page):
    import threading
    import urllib.error
    import urllib.request

    run, _ = page
    server, url = serve(run)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert b"relayrl inspect: run" in r.read()
        wrong = url.rsplit("/", 2)[0] + "/wrong-key/"
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(wrong, timeout=10)
        assert info.value.code == 404
    finally:
        server.shutdown()
        server.server_close()

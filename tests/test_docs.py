"""The user's pages (README.md and docs/*.md): the README is short and shows the two commands,
no page but the benchmarks page reads as a diary (dates, issue numbers, commits, milestones,
the machine the project is developed on), every relative link resolves, every page is reachable
from the README, and the recipe pages' commands run as written on small files.

(docs/config.md against the schema: tests/run/test_config_reference.py.)"""
from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpiutil import ROOT, clean_env

README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
USER_PAGES = [p for p in PAGES if p != BENCHMARKS]

# What makes a page a diary: dates, the project's issues, commits and milestones, and the
# machines it is developed on. Figures with their machine and date belong to docs/benchmarks.md.
HISTORY = re.compile(
    r"\b(19|20)\d\d-[01]\d-[0-3]\d(?!\d)"                    # 2026-11-25, 2026-11-25T10:00Z
    r"|\b(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.? (19|20)\d\d\b"   # November 2026
    r"|\bstops? \d+\b"                                      # stop 12
    r"|\b(issues?|PR|pull request|milestone)s? ?#?\d+"      # issue 13, issue #13
    r"|\bcommits? [0-9a-f]{7,40}\b"                         # commit 3de5b6b
    r"|\b(development|dev|loaded|shared) (vm|machine)\b"    # the development VM
    r"|\b2-core (vm|machine)\b",
    re.IGNORECASE)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _headings(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_readme_is_short_and_shows_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    commands = re.findall(r"^ {4}(make \w+)", text, flags=re.M)
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_user_pages_read_as_documentation_not_history(page):
    hits = [f"{page.name}:{i}: {line.strip()[:100]}" for i, line in enumerate(page.read_text().splitlines(), 1)
            if HISTORY.search(line)]
    assert not hits, "history on a user page (it belongs to git; figures to docs/benchmarks.md):\n" + \
        "\n".join(hits)


def test_the_history_pattern_catches_a_diary():
    diary = ["measured 2026-11-25 on the loaded development VM", "after stop 12", "issue 13's target",
             "(issue #46)", "commit 3de5b6b", "in November 2026", "calibration (2026-12-06T05:10:58Z)"]
    assert all(HISTORY.search(line) for line in diary)
    plain = ["2000 rows per destination", "METIS 5.2.1", "stop the run with SIGTERM", "epoch 12"]
    assert not any(HISTORY.search(line) for line in plain)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):     # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _headings(dest):
            bad.append(f"{target}: no heading #{anchor}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_every_page_is_reachable_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    assert {p.resolve() for p in DOCS.glob("*.md")} <= linked


def _commands(page: Path) -> str:
    """The page's ```sh blocks, in order: what a user types."""
    blocks = re.findall(r"^```sh\n(.*?)^```", page.read_text(), flags=re.M | re.S)
    assert blocks, f"{page.name} has no ```sh block"
    return "\n".join(blocks)


def _run_page(page: Path, cwd: Path) -> str:
    env = clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", _commands(page)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{page.name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_own_graph_page_runs(tmp_path):
    out = _run_page(DOCS / "own-graph.md", tmp_path)
    assert (tmp_path / "mygraph.h5").is_file() and (tmp_path / "mygraph-metis-2" / "meta.h5").is_file()
    assert "wrote mygraph.h5: " in out and "600 vertices" in out
    assert (tmp_path / "runs" / "mygraph" / "run.h5").is_file()
    assert re.search(r"^best val +\d+\.\d+% at epoch \d", out, flags=re.M)


def _gz(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.writelines(f"{row}\n" for row in rows)


def _tiny_ogb(root: Path, n: int = 240, classes: int = 4, seed: int = 0, binary: Path | None = None) -> None:
    """A small dataset in OGB's downloaded CSV layout (what `unzip arxiv.zip` gives), its
    labels learnable from features and edges; with ``binary``, the same data also in OGB's
    binary layout there (what `unzip papers100M-bin.zip` gives: raw/data.npz, raw/node-label.npz)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    feats = np.eye(classes)[labels] + rng.normal(0, 0.5, (n, classes))
    src = rng.integers(0, n, 6 * n)
    dst = np.array([rng.choice(np.flatnonzero(labels == labels[s])) for s in src])
    _gz(root / "raw" / "edge.csv.gz", (f"{s},{d}" for s, d in zip(src, dst)))
    _gz(root / "raw" / "node-feat.csv.gz", (",".join(f"{v:.4f}" for v in row) for row in feats))
    _gz(root / "raw" / "node-label.csv.gz", labels)
    _gz(root / "raw" / "num-node-list.csv.gz", [n])
    order = rng.permutation(n)
    for name, part in (("train", order[:120]), ("valid", order[120:180]), ("test", order[180:])):
        _gz(root / "split" / "time" / f"{name}.csv.gz", np.sort(part))
    if binary is not None:
        if str(ROOT / "tests" / "data") not in sys.path:
            sys.path.insert(0, str(ROOT / "tests" / "data"))
        from test_ogb_binary import make_binary

        make_binary(binary, np.stack([src, dst], axis=1), feats.astype(np.float32), labels.astype(np.float64), root)


def test_ogb_page_runs(tmp_path):
    _tiny_ogb(tmp_path / "arxiv", binary=tmp_path / "papers100M-bin")      # stands for the download steps
    out = _run_page(DOCS / "ogb.md", tmp_path)
    assert "wrote arxiv.h5: " in out and "240 vertices" in out
    binary = re.search(r"^wrote papers100M\.h5: .*(\n  .*)*", out, flags=re.M)   # the summary and its lines
    assert binary and "240 vertices" in binary[0] and "features bfloat16, indices int32" in binary[0], out
    assert (tmp_path / "runs" / "arxiv" / "run.h5").is_file()
    assert re.search(r"^best val +\d+\.\d+% at epoch \d", out, flags=re.M)

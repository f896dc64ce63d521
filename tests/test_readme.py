"""The README's generated performance block is what benchmarks/readme_performance.py makes from the
committed results file it names, and the README opens with the two set-up commands."""
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("readme_performance", ROOT / "benchmarks" / "readme_performance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_block_matches_its_results_file():
    gen = _generator()
    readme = (ROOT / "README.md").read_text()
    block = re.search(re.escape(gen.BEGIN) + ".*?" + re.escape(gen.END), readme, re.S)
    assert block, "README has no generated performance block"
    source = re.search(r"Raw figures: `([^`]+\.json)`", block.group(0))
    assert source, "the block does not name its results file"
    grid = json.loads((ROOT / source.group(1)).read_text())
    assert block.group(0) == gen.section(grid, str(ROOT / source.group(1)))


def test_readme_opens_with_the_two_setup_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    fence = lines.index("```bash")
    commands = lines[fence + 1:lines.index("```", fence + 1)]
    assert [c.split("#")[0].strip() for c in commands] == [
        "bash scripts/setup.sh && .venv/bin/python -m ffl_backend.demo", "bash scripts/test.sh"]
    assert len(lines) <= 200

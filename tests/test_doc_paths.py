"""Every `benchmarks/...` or `docs/...` path named in the code, the tests, the scripts, the benchmarks
and the docs exists in the repository, so a comment that points to a results file can be followed.

A token counts as a path when it starts with `benchmarks/` or `docs/` (optionally `../`, as the docs'
relative links write it) and is not the tail of a longer path or URL. It passes when, relative to the
repository root:
- the file or folder exists, and an `#anchor` after a Markdown file is one of its headings, or
- it holds `*` and the glob matches at least one file, or
- it is an output prefix: files named `<path>.<ext>` exist (`ffl-bench --out benchmarks/results/x`
  writes x.json, x.md, ...), or
- it is a template: the token runs on into `{` or `<` (an f-string, `{a,b}`, `<name>`), or
- it is in ALLOWED below, with its reason.
"""
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PATH_RE = re.compile(r"(?<![\w/.-])(?:\.\./)?((?:benchmarks|docs)/[\w./*-]*[\w*])(?:#([\w-]+))?")
RUN_ON = re.compile(r"[\w./*-]*")  # the rest of a token's path characters, before a template's `{` or `<`

# Paths named on purpose although they are not committed: path -> why. Keep this short.
ALLOWED: dict[str, str] = {
    "benchmarks/x.py": "tests/bench/test_grid.py: a made-up sys.argv[0] for report_row's command stamp",
}


def _sources() -> list[Path]:
    """The files whose path tokens are checked."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder, suffixes in (("ffl_backend", {".py", ".cpp", ".h"}),
                             ("tests", {".py", ".sh", ".md"}),
                             ("scripts", {".py", ".sh", ".md"}),
                             ("examples", {".py", ".md"}),
                             ("benchmarks", {".py", ".md", ".sh"})):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in suffixes)
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def _exists(token: str) -> bool:
    if "*" in token:
        return any(ROOT.glob(token))
    path = ROOT / token
    return path.exists() or any(path.parent.glob(path.name + ".*"))


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(md: str) -> frozenset[str]:
    text = re.sub(r"^```.*?^```", "", (ROOT / md).read_text(), flags=re.S | re.M)  # no headings in code
    return frozenset(slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M))


def path_tokens(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, path, anchor or None) of every path token in `text` that is not a template."""
    found = []
    for m in PATH_RE.finditer(text):
        rest = RUN_ON.match(text, m.end(1)).end()
        if text[rest:rest + 1] in ("{", "<"):
            continue
        found.append((text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)))
    return found


def _problem(token: str, anchor: str | None) -> str | None:
    if token in ALLOWED:
        return None
    if not _exists(token):
        return "missing"
    if anchor and token.endswith(".md") and (ROOT / token).is_file() and anchor not in _anchors(token):
        return f"no heading for #{anchor}"
    return None


def test_path_tokens_are_found():
    text = ("see benchmarks/ab_decode.py, and (docs/performance.md#gpu-kernels). [x](../benchmarks/results/a.md)\n"
            "not https://example.org/docs/page nor src/benchmarks/x.py; f'benchmarks/results/{name}.json'")
    assert path_tokens(text) == [(1, "benchmarks/ab_decode.py", None), (1, "docs/performance.md", "gpu-kernels"),
                                 (1, "benchmarks/results/a.md", None)]
    assert slug("Decode attention, packed linears and prompts") == "decode-attention-packed-linears-and-prompts"


def test_every_named_benchmarks_or_docs_path_exists():
    sources = _sources()
    assert len(sources) > 50, "the source walk found almost nothing"
    problems = []
    for source in sources:
        for line, token, anchor in path_tokens(source.read_text(errors="replace")):
            problem = _problem(token, anchor)
            if problem:
                named = token + (f"#{anchor}" if anchor else "")
                problems.append(f"{source.relative_to(ROOT)}:{line}: {named} ({problem})")
    assert not problems, f"{len(problems)} named path(s) do not resolve:\n" + "\n".join(problems)

"""README.md and docs/**/*.md are written for users, not as a lab notebook.

Each check finds one kind of leftover of how the project got there: issue references,
first person in prose, commit hashes in prose (a study's provenance may name its commit
once per top-level section), pasted `time` output, and "before this work". Code blocks,
inline code and quoted text are not prose for the first-person check; a commit hash
counts only where git knows it as an object (without git, every hash-like token counts).
"""

import functools
import glob
import os
import re
import shutil
import subprocess

import pytest

from tests import conftest

DOCS = ("README.md", *sorted(
    os.path.relpath(p, conftest.REPO_ROOT)
    for p in glob.glob(os.path.join(conftest.REPO_ROOT, "docs", "**", "*.md"), recursive=True)))

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
_ISSUE = re.compile(r"\bissues? #?\d+\b|(?<![\w&/])#\d+\b", re.I)
_FIRST_PERSON = re.compile(r"\b(?:I|we|We|our|Our|ours|Ours)\b")
_HEX = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w])")
_TIME_OUTPUT = re.compile(r"^[ \t]*(?:real|user|sys)[ \t]+\d+m\d+(?:\.\d+)?s[ \t]*$", re.M)
_BEFORE_THIS_WORK = re.compile(r"before this work", re.I)


def _read(doc: str) -> str:
  with open(os.path.join(conftest.REPO_ROOT, doc), encoding="utf-8") as f:
    return f.read()


def _without_code_blocks(text: str) -> str:
  """The text with fenced and indented code blocks blanked (line numbers kept)."""
  text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
  lines, previous_blank, in_block = text.split("\n"), True, False
  for i, line in enumerate(lines):
    if line.strip() and (in_block or previous_blank) and re.match(r"^ {4,}\S", line):
      in_block = True
      lines[i] = ""
      continue
    if line.strip():
      in_block = False
    previous_blank = not line.strip()
  return "\n".join(lines)


def _prose(text: str) -> str:
  """Prose only: no code blocks, no inline code, no double-quoted text."""
  text = _without_code_blocks(text)
  text = re.sub(r"`[^`\n]*(?:\n[^`\n]*){0,2}`", _blank, text)
  return re.sub(r"\"[^\"\n]*(?:\n[^\"\n]*){0,3}\"|“[^”]*”", _blank, text)


def _blank(match: re.Match) -> str:
  """A span emptied, its line breaks kept (so hits keep their line numbers)."""
  return "\"\"" + "\n" * match.group(0).count("\n")


def _hits(pattern: re.Pattern, text: str) -> list[str]:
  return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
          for m in pattern.finditer(text)]


@functools.cache
def _git_objects(tokens: frozenset) -> frozenset | None:
  """Which of `tokens` git knows as objects (one `git cat-file` call); None without git."""
  if not shutil.which("git") or not os.path.exists(os.path.join(conftest.REPO_ROOT, ".git")):
    return None
  ordered = sorted(tokens)
  out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=conftest.REPO_ROOT,
                       input="".join(f"{t}\n" for t in ordered), capture_output=True,
                       text=True, check=False).stdout.splitlines()
  if len(out) != len(ordered):
    return None
  return frozenset(t for t, line in zip(ordered, out) if not line.endswith("missing")
                   and not line.endswith("ambiguous"))


def _all_hex_tokens() -> frozenset:
  return frozenset(m.group(0) for doc in DOCS
                   for m in _HEX.finditer(_without_code_blocks(_read(doc))))


@pytest.mark.parametrize("doc", DOCS)
def test_no_issue_references(doc):
  hits = _hits(_ISSUE, _without_code_blocks(_read(doc)))
  assert not hits, f"{doc} refers to issues (say what the reader needs instead):\n" + \
      "\n".join(hits)


@pytest.mark.parametrize("doc", DOCS)
def test_no_first_person_in_prose(doc):
  hits = _hits(_FIRST_PERSON, _prose(_read(doc)))
  assert not hits, f"{doc} speaks in the first person:\n" + "\n".join(hits)


@pytest.mark.parametrize("doc", DOCS)
def test_at_most_one_commit_per_top_level_section(doc):
  known = _git_objects(_all_hex_tokens())
  text = _without_code_blocks(_read(doc))
  sections = re.split(r"^# ", text, flags=re.M)
  too_many = []
  for section in sections:
    commits = sorted({m.group(0) for m in _HEX.finditer(section)
                      if known is None or m.group(0) in known})
    if len(commits) > 1:
      too_many.append(f"{section.splitlines()[0][:60]!r}: {', '.join(commits)}")
  assert not too_many, (f"{doc} names commits in its prose (a study's provenance may name "
                        "its commit once):\n" + "\n".join(too_many))


@pytest.mark.parametrize("doc", DOCS)
def test_no_pasted_time_output(doc):
  hits = _hits(_TIME_OUTPUT, _read(doc))
  assert not hits, f"{doc} pastes `time` output (state the figure, machine and date):\n" + \
      "\n".join(hits)


@pytest.mark.parametrize("doc", DOCS)
def test_no_history_of_the_work(doc):
  hits = _hits(_BEFORE_THIS_WORK, _read(doc))
  assert not hits, f"{doc} tells the project's history:\n" + "\n".join(hits)


def test_the_checks_find_each_kind_of_leftover():
  notebook = ("Fixed in issue 12 and #40.\n\nI ran it; we saw 3x.\n\nAs of 1d34430 and "
              "614be4a.\n\n    real\t0m3.2s\n\nSlower before this work.\n")
  assert len(_hits(_ISSUE, notebook)) == 2
  assert len(_hits(_FIRST_PERSON, _prose(notebook))) == 2
  assert {m.group(0) for m in _HEX.finditer(notebook)} == {"1d34430", "614be4a"}
  assert len(_hits(_TIME_OUTPUT, notebook)) == 1
  assert len(_hits(_BEFORE_THIS_WORK, notebook)) == 1
  clean = ("Says `we` in code and \"I ran\" in a quote.\n\n    we ran\n\n"
           "See [the plan](#memory-plan); `aot_qwen7b.json`, 1e-5, 0.75.\n")
  assert not _hits(_FIRST_PERSON, _prose(clean))
  assert not _hits(_ISSUE, _without_code_blocks(clean))
  assert not list(_HEX.finditer(_without_code_blocks(clean)))

"""Shows that a commit only moved train_gpt.py's top-level blocks: every function, class and statement, with the comments
right above it, is in both versions exactly once and character for character; only the section banners (a title
between two `# ====` lines) and the blank lines between blocks may differ.

    python bench/pure_moves.py BASE_COMMIT [NEW_COMMIT]     (NEW_COMMIT: the working tree's file if left out)

Exit 0 with a count of the blocks and of those that moved; 1 naming each block that is not in both."""
import argparse
import ast
import collections
import re
import subprocess
import sys
from pathlib import Path

BANNER = re.compile(r"# =+\n# [^\n]*\n# =+\n")


def blocks(source: str) -> list:
    """Each top-level statement with the comment lines right above it, banners and the blank lines around it left
    out, in file order."""
    lines = source.splitlines(keepends=True)
    out, start = [], 0
    for node in ast.parse(source).body:
        end = node.end_lineno
        text = BANNER.sub("", "".join(lines[start:end]))
        out.append(text.strip("\n"))
        start = end
    tail = BANNER.sub("", "".join(lines[start:])).strip("\n")
    if tail:
        out.append(tail)
    return out


def read(commit, path="train_gpt.py") -> str:
    if commit is None:
        return Path(path).read_text()
    return subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("new", nargs="?")
    args = parser.parse_args(argv)
    before, after = blocks(read(args.base)), blocks(read(args.new))
    missing = collections.Counter(before) - collections.Counter(after)
    added = collections.Counter(after) - collections.Counter(before)
    for label, problems in (("only in the base", missing), ("only in the new version", added)):
        for text in problems:
            print(f"{label}: {text.splitlines()[0][:100]!r} ({len(text.splitlines())} lines)")
    if missing or added:
        return 1
    order = {text: i for i, text in enumerate(before)}
    moved = sum(1 for i, text in enumerate(after) if i == 0 or order[text] != order[after[i - 1]] + 1)
    print(f"pure moves: {len(after)} top-level blocks, each identical in both; {moved} runs of blocks moved")
    return 0


if __name__ == "__main__":
    sys.exit(main())

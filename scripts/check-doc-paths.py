#!/usr/bin/env python3
"""Every repository path the docs cite exists: README.md and docs/*.md, in backticks or as a
relative link, under one of the tree's top-level folders (a `file.cpp:123` line suffix is allowed,
and so are globs). Paths outside the repository (../shared) are refused: the docs stand alone. Exit 1 with the list. Usage: check-doc-paths.py [ROOT] (default: this repository). A ctest runs it (tests/CMakeLists.txt)."""
import glob
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tops = ("include/", "src/", "tools/", "tests/", "python/", "scripts/", "docs/", "bench/", "cmake/", ".ci/")
token = re.compile(r"`([^`\s]+)`|\]\(([^)\s#]+)(?:#[^)]*)?\)")
missing = []
docs = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
for doc in docs:
    rel_doc = os.path.relpath(doc, root)
    with open(doc, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            for m in token.finditer(line):
                raw = m.group(1) or m.group(2)
                if raw.startswith(("http://", "https://", "mailto:")):
                    continue
                if "../shared" in raw or raw.startswith("shared/"):
                    missing.append(f"{rel_doc}:{lineno}: {raw} (outside the repository: the docs stand alone)")
                    continue
                if m.group(2):  # a link: relative to the document
                    path = os.path.normpath(os.path.join(os.path.dirname(rel_doc), raw))
                else:
                    path = raw
                path = re.sub(r":\d+(-\d+)?(,\d+)*$", "", path.rstrip(".,;:)"))
                if not path.startswith(tops):
                    continue
                if "<" in path or "{" in path or "$" in path or "..." in path or "…" in path:
                    continue  # a pattern, not a path
                full = os.path.join(root, path)
                if any(c in path for c in "*?["):
                    ok = bool(glob.glob(full))
                else:
                    ok = os.path.exists(full)
                if not ok:
                    missing.append(f"{rel_doc}:{lineno}: {raw}")
if missing:
    print("docs cite repository paths that do not exist:\n  " + "\n  ".join(missing))
    sys.exit(1)
print(f"docs: every cited repository path exists ({len(docs)} documents)")

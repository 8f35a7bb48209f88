"""The tree's layout: every test module has a basename of its own (pytest imports test modules by basename: two of
one name stop the whole suite's collection)."""

import collections
import pathlib


def test_test_modules_have_unique_basenames():
    root = pathlib.Path(__file__).parent
    names = collections.defaultdict(list)
    for path in root.rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(root)))
    assert not {n: p for n, p in names.items() if len(p) > 1}

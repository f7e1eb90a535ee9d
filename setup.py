"""Build hook: entry_points.txt in the order pyproject.toml gives, not sorted by name.

torchx takes the first entry of the ``torchx.schedulers`` group as the default
scheduler of ``torchx run`` and ``torchx list`` without ``-s``
(``torchx.schedulers.get_default_scheduler_name``), and an entry in that group
hides all of torchx's own, so pyproject.toml registers them again in torchx's
order (``DEFAULT_SCHEDULER_MODULES``, ``local_docker`` first). setuptools
writes each group sorted by name, which made ``aws_batch`` the default of
every torchx command once elastic_ft was installed; hatchling, flit-core,
pdm-backend and poetry-core sort too. Every build (wheel, sdist, editable,
metadata only) writes the file through the ``egg_info`` command, so rewriting
it there, from the same entries, covers them all. Everything else is in
pyproject.toml.
"""

import configparser
import os

from setuptools import setup
from setuptools.command.egg_info import egg_info


def _pairs(items):
    """``name = value`` items (a list, or ini text) as (name, value) pairs, in order."""
    if isinstance(items, str):
        items = items.splitlines()
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if sep:
            pairs.append((name.strip(), value.strip()))
    return pairs


class OrderedEntryPoints(egg_info):
    """egg_info, then entry_points.txt rewritten with each group in the order it was given."""

    def run(self):
        super().run()
        path = os.path.join(self.egg_info, "entry_points.txt")
        given = {group: _pairs(items) for group, items in (self.distribution.entry_points or {}).items()}
        written = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        written.optionxform = str  # keep names' case
        written.read(path, encoding="utf-8")
        # The same entries as setuptools wrote, only reordered; anything else would be a silent change.
        as_written = {(g, n, v) for g in written.sections() for n, v in written.items(g)}
        as_given = {(g, n, v) for g, pairs in given.items() for n, v in pairs}
        if as_written != as_given:
            raise RuntimeError(f"entry_points.txt differs from the given entry points: {as_written ^ as_given}")
        text = "".join(f"[{g}]\n" + "".join(f"{n} = {v}\n" for n, v in pairs) + "\n" for g, pairs in given.items())
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


setup(cmdclass={"egg_info": OrderedEntryPoints})

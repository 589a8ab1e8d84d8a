"""The ``mergefs`` command line: ``main`` parses (:mod:`.app`), each command calls
:mod:`mergefs.ops` (:mod:`.commands`) and prints what it returns (:mod:`.render`)."""

from mergefs.cli.app import entry, main

__all__ = ["entry", "main"]

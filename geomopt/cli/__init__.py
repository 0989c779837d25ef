"""The ``geomopt`` command line: :mod:`.main` (lint, plan, explain, init, fmt, schema, rule),
:mod:`.lock` (plan --lock / --check), :mod:`.demo`, :mod:`.bench`; :mod:`.status`: the exit statuses and
the user mistake (exit 2) they all raise, apart from main, which imports the others."""

"""``python -m rollplex``: the ``rollplex`` command line (see ``rollplex.cli``)."""

from rollplex.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

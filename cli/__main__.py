"""``python -m kvstrata.cli`` (as ``python -m kvstrata``)."""

from kvstrata.cli import main

main()

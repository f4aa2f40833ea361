"""``python -m kvstrata``."""

from kvstrata.cli import main

main()

"""Integrations of kvstrata with inference engines (importing this package imports none of them)."""

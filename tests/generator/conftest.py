"""The generator room's fixtures: ``variant`` (a small gfx950 variant) and ``source`` (its rendered source)."""

from tests.support.variants import source, variant  # noqa: F401 (fixtures)

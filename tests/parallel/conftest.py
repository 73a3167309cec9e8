"""The ``ranks`` fixture: ``ranks(world, fn, *args)`` runs ``fn`` on ``world`` CPU processes (harness)."""

from __future__ import annotations

import pytest

from tests.parallel.harness import RankPool


@pytest.fixture(scope="session")
def ranks():
    pools: dict[int, RankPool] = {}

    def run(world: int, fn, *args):
        pool = pools.get(world)
        if pool is None or pool.broken:
            pools[world] = pool = RankPool(world)
        return pool.run(fn, *args)

    yield run
    for pool in pools.values():
        pool.close()

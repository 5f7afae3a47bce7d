"""Fixtures the real-engine modules share: one kvstore cluster and one checkpoint per module
(an engine module starts its engines once, against them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.vllm_engines import engine_checkpoint, kvstore_cluster


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, str]]:
    """A private kvstore cluster for the module; its engines' forwards bound to the cores the
    module's ``OMP_BIND`` names (``VLLM_CPU_OMP_THREADS_BIND``; default core 0)."""
    bind = getattr(request.module, "OMP_BIND", "0")
    with kvstore_cluster(tmp_path_factory.mktemp("state"), omp_bind=bind) as env:
        yield env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return engine_checkpoint(tmp_path_factory)

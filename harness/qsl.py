"""The LoadGen query sample library over the sample store: LoadGen's load/unload callbacks prepare and
drop prompts (token ids + image bytes) so issuing a query costs only a message send."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import mlperf_loadgen as lg

logger = logging.getLogger(__name__)


class LoadableStore(Protocol):
    def load(self, indices: Sequence[int]) -> None: ...

    def unload(self, indices: Sequence[int]) -> None: ...


class StoreQSL:
    """Owns the LoadGen QSL handle for `total` samples of which `performance_count` stay loaded.

    LoadGen itself loads min(its performance_sample_count, total) samples (GenerateLoadableSets in
    mlcommons/inference loadgen/loadgen.cc); the QSL reports the same, so a catalogue smaller than the published
    one the config was validated against (a stand-in with the real layout) is simply loaded whole.
    """

    def __init__(self, store: LoadableStore, total: int, performance_count: int) -> None:
        if performance_count > total:
            logger.info("performance_sample_count %d is more than this catalogue's %d samples: all of them stay "
                        "loaded", performance_count, total)
        self._store = store
        self.total = total
        self.performance_count = min(performance_count, total)
        self.handle = lg.ConstructQSL(total, self.performance_count, self._load, self._unload)

    def _load(self, indices: list[int]) -> None:
        logger.info("loading %d samples", len(indices))
        self._store.load(indices)

    def _unload(self, indices: list[int]) -> None:
        logger.info("unloading %d samples", len(indices))
        self._store.unload(indices)

    def close(self) -> None:
        lg.DestroyQSL(self.handle)

"""The random inputs of the test session: one seed per session, fresh unless CUFLASH_TEST_SEED is
set, printed in pytest's header (tests/conftest.py), and a generator per test case derived from it
and the case's parameters by a stable hash (Python's own str hash changes from process to process,
which would make a printed seed useless for rerunning a failure)."""
import os
import zlib

import numpy as np

#: The session's seed: CUFLASH_TEST_SEED, or fresh entropy (fresh inputs every run).
SEED = int(os.environ.get("CUFLASH_TEST_SEED") or np.random.SeedSequence().entropy)


def case_rng(seed, *key):
    """A generator for one test case from `seed` and the case's parameters `key` (any values;
    their str() is hashed with CRC-32, the same in every process)."""
    return np.random.default_rng([int(seed) % 2**32,
                                  *[zlib.crc32(str(x).encode()) for x in key]])

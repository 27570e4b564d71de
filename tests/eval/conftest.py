"""The measuring verbs read the machine's load average and cores (nanospec_fx.eval.cores): in these tests both
are fixed, so no output depends on how busy the machine running them is. A test that needs other values
monkeypatches them again."""
import pytest

from nanospec_fx.eval import cores

QUIET_LOAD = [0.25, 0.25, 0.25]
CORES = 2


@pytest.fixture(scope="session", autouse=True)
def quiet_machine():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cores, "load_average", lambda: list(QUIET_LOAD))
        mp.setattr(cores, "usable_cores", lambda: CORES)
        yield
